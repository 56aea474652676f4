"""The canonical kernels: plain PyTorch functions whose result for every row (token) depends only on
that row's inputs, never on batch size, padding, position in the batch, prefill vs decode, chunking
or thread count.

How each achieves it, in one line each (details in each module):

- reductions are row-wise kernels whose order depends only on the row: a GEMM against ones
  (RMSNorm's sum of squares), torch's CPU (log-)softmax, which computes each row alone (measured,
  asserted, and for attention unchanged by appended masked 64-slot blocks), or halving trees of
  elementwise adds over a zero-padded power-of-two length (``reduce.tree_sum``: MoE, GatedDeltaNet,
  attention's key blocks), so trailing zeros (padding, unseen keys) never change a sum;
- transcendental functions use only ops whose vectorised and scalar paths agree bit for bit
  (exp, log, log1p, rsqrt, cos, sin, division: measured), never ``sigmoid``/``silu``/``softplus``
  (whose vectorised tails differ);
- GEMMs run over rows zero-padded to a multiple of 8 (``linear``), for which the BLAS result of
  a row depends only on that row (and of a column only on that column's weights);
- attention scores and weighted sums use fixed-shape key blocks aligned at the sequence start.

Each is one implementation, called by the transformers op sites (``skyrl_core.ops.hf``) and, as
opaque ``isoexec::`` custom ops (``skyrl_isoexec.torch_ops``), by engines that compile.
"""

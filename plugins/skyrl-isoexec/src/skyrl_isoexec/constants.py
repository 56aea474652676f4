"""The pinned constants of the canonical kernels (importable without torch).

Every value that changes a canonical kernel's bits lives here, is read by the kernel, and is
declared in that kernel's ``OpImplSpec`` (so it enters the contract hash). Changing one is a new
contract: bump the op's version in ``specs.py`` too.
"""

# GEMM rows are zero-padded to a multiple of this, then computed in one GEMM (kernels/linear.py).
LINEAR_ROW_ALIGN = 8
# Which GEMM: CPU fp32 on oneDNN (torch.ops.mkldnn._linear_pointwise), CPU bf16 and CUDA on torch.mm.
LINEAR_KERNEL = "cpu fp32: oneDNN; cpu bf16: torch.mm (oneDNN); cuda: torch.mm"
LINEAR_MIN_COLUMNS = 8  # narrower weights are zero-padded to this many output columns
LINEAR_DTYPES = ("float32", "bfloat16")

# Attention GEMMs (see kernels/attention.py): query rows padded to a multiple of 8, keys in blocks.
ATTENTION_ROW_ALIGN = 8
ATTENTION_KEY_BLOCK = 64

# Positions per rotary cos/sin table block (see kernels/elementwise.py).
ROPE_TABLE_BLOCK = 256

# Tokens per MoE expert GEMM block are the linear row blocks; the combine order is slot order.
MOE_COMBINE_ORDER = "top-k slot order, fp32"

# GatedDeltaNet: one recurrent scan form at every site, fp32 state (see kernels/gdn.py).
GDN_SCAN = "recurrent, fp32 state, tree-ordered reductions"

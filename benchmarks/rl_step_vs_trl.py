"""One GRPO step: skyrl vs TRL's ``GRPOTrainer`` on the same work, alternating, in one run.

The work: SmolLM2-135M-Instruct (fp32, converted by ``skyrl_core.models.prepare_smollm2``),
8 prompts x 8 samples per step, up to 32 new tokens sampled at temperature 1, the prompt
"What is a + b? Answer with just the number." (a, b in 0..49) rewarded 1/0 for the right integer,
one optimizer step per step (AdamW, same learning rate), 2 intra-op threads.

skyrl runs ``skyrl_core.trainer.rl.train`` (skyrl-torch engine, FSDP2 backend, PPO-clip loss, GRPO
advantages); TRL runs ``GRPOTrainer`` (HF ``generate``, ``num_iterations=1``, ``beta=0``). Blocks of
``--steps`` steps alternate ``--rounds`` times (TRL, skyrl, TRL, skyrl, ...) so that a busy machine
slows both alike; the first step of every block (warm-up) is not counted. A step's time is the
wall time from sampling to the updated weights (for skyrl, including the weight sync to its engine).
Every block runs in a fresh child process, as each framework's users run it: skyrl's process
tunes its allocator and takes oneDNN for fp32 GEMMs (its defaults); TRL's runs stock PyTorch.

Before that, rollout throughput at batch 64 (64 different prompts, 32 new tokens): the skyrl-torch
engine vs HF ``generate``, each in its own process, ``--gen-repeats`` runs after a warm-up,
alternating ``--rounds`` times.

Each framework runs in fp32 and in bf16 (``--dtypes``): skyrl with ``model.dtype: bfloat16`` (bf16
engine, bf16 forward/backward over fp32 master weights and optimizer, fp32 logprobs and loss); TRL
with ``bf16=True`` (HF Trainer's CPU autocast over its fp32 model), its fastest CPU setting being
whichever of the two is faster here.

Beside the times: this machine's limit for the same work (``benchmarks/_roofline.py``, measured in
this run before the blocks and after them, best kept): the GEMM FLOPs of one step (sampling 64
responses, then forward and backward over the 64 sequences; response lengths as skyrl's runs
sampled them), the fastest measured rate of each product's shape in fp32 and bf16, hence each
dtype's floor, and the fraction of that peak each side reached. skyrl trains each prompt once for
its 8 rows (``backend.options.share_prompts``): its work is smaller than TRL's, so it is also
printed against the floor of its own work. The CPU and the GEMM libraries are printed with the
result.

The last lines: median step times, the fp32 ratio skyrl / TRL, the bf16 ratio (skyrl bf16 / TRL in
its fastest setting), and the targets: skyrl's fp32 step <= 1.2x the fp32 floor, skyrl's bf16 step
<= 1/4 of TRL's fp32 step.

    python benchmarks/rl_step_vs_trl.py [--rounds 2] [--steps 3] [--threads 2] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _roofline import Roofline, decoder_gemms, generation_gemms, machine, uptime

PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 32
LEARNING_RATE = 1e-6


def problems(count: int, seed: int) -> list[dict[str, Any]]:
    from skyrl_envs.arithmetic import problem_row

    rng = random.Random(seed)
    return [problem_row(rng.randint(0, 49), rng.randint(0, 49), "+") for _ in range(count)]


# --- rollout throughput -------------------------------------------------------------------------


def generation_rates(side: str, model_dir: str, repeats: int) -> list[float]:
    """Generated tokens/s at batch 64 of ``side`` ("skyrl": the skyrl-torch engine; "hf": HF
    ``generate``), ``repeats`` times after one warm-up."""
    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer
    from skyrl_core.rollout import ChatCodec
    from skyrl_core.types import GenerationRequest, SamplingParams

    model_config = ModelConfig(path=model_dir)
    codec = ChatCodec(load_tokenizer(model_config))
    prompts = [codec.render_prompt(row["prompt"]) for row in problems(64, seed=1)]
    eos = codec.eos_token_id

    if side == "skyrl":
        from skyrl_torch.engine import TorchEngine

        engine = TorchEngine(model_config, None, seed=0)

        def run(seed: int) -> int:
            params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=seed, stop_token_ids=(eos,))
            out = engine.generate([GenerationRequest(request_id=str(i), prompt_token_ids=p, sampling=params)
                                   for i, p in enumerate(prompts)])
            return sum(len(s[0].token_ids) for s in out)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        width = max(map(len, prompts))
        input_ids = torch.tensor([[codec.pad_token_id] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run(seed: int) -> int:
            torch.manual_seed(seed)
            with torch.no_grad():
                out = hf.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos,
                                  pad_token_id=codec.pad_token_id)
            new = out[:, width:].tolist()
            return sum(row.index(eos) + 1 if eos in row else len(row) for row in new)

    rates = []
    for repeat in range(repeats + 1):  # the first run warms up
        started = time.perf_counter()
        tokens = run(repeat)
        if repeat:
            rates.append(tokens / (time.perf_counter() - started))
    return rates


# --- one block of RL steps per framework ------------------------------------------------------


def skyrl_block(model_dir: str, data_path: str, steps: int, out_dir: str, seed: int, dtype: str) -> dict[str, Any]:
    """Step times (s) of a fresh ``steps``-step skyrl run in ``dtype``, and its response lengths."""
    from skyrl_core.config.loader import structure_config
    from skyrl_core.trainer.rl import train

    cfg = structure_config({
        "model": {"path": model_dir, "dtype": dtype},  # the engine's and the trainer's compute dtype
        "engine": "torch",
        "backend": "fsdp",
        "environment": "arithmetic",
        "algorithm": {"policy_loss": "ppo", "advantage": "grpo", "loss_reduction": "token_mean"},
        "data": {"train": data_path, "prompts_per_step": PROMPTS_PER_STEP},
        "generation": {"n_samples": SAMPLES_PER_PROMPT, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0},
        "trainer": {"steps": steps, "lr": LEARNING_RATE, "mini_batches": 1, "micro_batch_size": 16, "seed": seed,
                    "output_dir": out_dir, "plot": False, "progress": False},
    })
    result = train(cfg)
    steps_run = [r for r in result.history if "time/step" in r]
    return {
        "times": [r["time/step"] for r in steps_run],
        "response_mean": [r["response_length/mean"] for r in steps_run],
        "response_max": [r["response_length/max"] for r in steps_run],
    }


def trl_block(model_dir: str, rows: list[dict[str, Any]], steps: int, out_dir: str, seed: int, dtype: str) -> list[float]:
    """Step times (s) of a fresh ``steps``-step TRL ``GRPOTrainer`` run (``bfloat16``: ``bf16=True``,
    HF Trainer's CPU autocast over the fp32 model)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from skyrl_envs.arithmetic import parse_integer_answer

    def correct(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(parse_integer_answer(t) == int(a)) for t, a in zip(texts, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._started)

    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_spec"]["ground_truth"]} for r in rows])
    config = GRPOConfig(
        output_dir=out_dir, max_steps=steps, learning_rate=LEARNING_RATE, seed=seed,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT, num_generations=SAMPLES_PER_PROMPT,
        gradient_accumulation_steps=1, num_iterations=1, beta=0.0, temperature=1.0,
        max_completion_length=MAX_NEW_TOKENS, use_vllm=False, use_cpu=True, bf16=dtype == "bfloat16",
        logging_strategy="no", report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    del trainer, model
    gc.collect()
    return timer.times


def trl_problem() -> str | None:
    """Why TRL cannot run here, or None."""
    if importlib.util.find_spec("trl") is None:
        return "TRL is not installed (pip install trl datasets: pick a version that keeps this torch and transformers)"
    try:
        import trl  # noqa: F401
        from trl import GRPOTrainer  # noqa: F401
    except Exception as exc:  # a TRL incompatible with the installed transformers
        return f"TRL does not import with this transformers: {type(exc).__name__}: {exc}"
    return None


def worker(kind: str, args: argparse.Namespace) -> Any:
    """One measurement in this (fresh) process; returns what ``main`` prints."""
    import torch

    torch.set_num_threads(args.threads)
    if kind in ("gen-skyrl", "gen-hf"):
        return generation_rates(kind.removeprefix("gen-"), args.model_dir, args.gen_repeats)
    if kind == "trl":
        from skyrl_core.data import load_dataset

        rows = load_dataset(args.data, default_env_class="arithmetic")
        return trl_block(args.model_dir, rows, args.steps, args.out, seed=args.seed, dtype=args.dtype)
    return skyrl_block(args.model_dir, args.data, args.steps, args.out, seed=args.seed, dtype=args.dtype)


def run_worker(kind: str, args: argparse.Namespace, **extra: Any) -> Any:
    """``worker(kind)`` in a child process: each framework runs as its users run it, in a process of
    its own (skyrl tunes its process's allocator, TRL does not; nothing leaks between them)."""
    command = [sys.executable, __file__, "--worker", kind, "--threads", str(args.threads), "--steps", str(args.steps),
               "--gen-repeats", str(args.gen_repeats), "--model-dir", args.model_dir, "--dtypes", "float32"]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"benchmark worker {kind} failed (exit {done.returncode}); its output:\n{done.stdout[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="TRL/skyrl block pairs")
    parser.add_argument("--steps", type=int, default=3, help="steps per block (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gen-repeats", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("gen-skyrl", "gen-hf", "trl", "skyrl"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each block is warm-up)")
    args.dtypes = args.dtypes.split(",")
    if "float32" not in args.dtypes or not set(args.dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--dtypes must list float32 and optionally bfloat16; got {','.join(args.dtypes)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        print(json.dumps(worker(args.worker, args)), flush=True)
        return

    from skyrl_core.models import prepare_smollm2

    args.model_dir = str(prepare_smollm2())
    # Both trainers write checkpoints (about 3 GB per run): removed however the run ends.
    work = tempfile.mkdtemp(prefix="skyrl-bench-trl-")
    try:
        _compare(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _prompt_tokens(model_dir: str, rows: list[dict[str, Any]]) -> float:
    """Mean chat-templated prompt length in tokens (what both frameworks feed the model)."""
    from skyrl_core.config.schema import ModelConfig
    from skyrl_core.models import load_tokenizer
    from skyrl_core.rollout import ChatCodec

    codec = ChatCodec(load_tokenizer(ModelConfig(path=model_dir)))
    return statistics.mean(len(codec.render_prompt(row["prompt"])) for row in rows)


def step_gemms(model_dir: str, prompt_mean: float, response_mean: float, response_max: float,
               *, shared_prompts: bool = False) -> list:
    """The linear layers' products of one step: sampling 64 responses (prefill, then one decode step
    per token of the longest response), then forward and backward over the 64 sequences (logits on
    the response positions). ``shared_prompts``: training computes each prompt once for its 8 rows
    (what skyrl's FSDP backend does, ``backend.options.share_prompts``), not once per row (TRL)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    rows = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    prompt, response = round(rows * prompt_mean), round(rows * response_mean)
    trained_prompt = round(PROMPTS_PER_STEP * prompt_mean) if shared_prompts else prompt
    return (generation_gemms(config, prompt, response, rows, max(1, round(response_max)))
            + decoder_gemms(config, trained_prompt + response, response, backward=True))


def _compare(args: argparse.Namespace, work: str) -> None:
    from skyrl_core.data import write_jsonl

    rows = problems(PROMPTS_PER_STEP * args.steps * args.rounds * 2, seed=0)
    data_path = str(write_jsonl(rows, os.path.join(work, "train.jsonl")))
    print(machine(), flush=True)
    print(f"SmolLM2-135M-Instruct, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples, "
          f"{MAX_NEW_TOKENS} new tokens, {args.threads} threads, dtypes {', '.join(args.dtypes)}; "
          f"each block in a fresh process", flush=True)

    rates: dict[str, list[float]] = {"skyrl": [], "hf": []}
    for _ in range(args.rounds):
        for side in ("skyrl", "hf"):
            rates[side] += run_worker(f"gen-{side}", args)
    engine_rate, hf_rate = statistics.median(rates["skyrl"]), statistics.median(rates["hf"])
    print(f"rollout tokens/s at batch 64 (fp32): skyrl-torch {engine_rate:.0f}, HF generate {hf_rate:.0f}, "
          f"ratio {engine_rate / hf_rate:.1f}x (target >= 15x)", flush=True)

    # The roofline's shapes need the sampled lengths: a first estimate now (prompts measured,
    # responses at the budget's half), the work's own shapes after the blocks.
    prompt_mean = _prompt_tokens(args.model_dir, rows)
    estimate = Roofline(step_gemms(args.model_dir, prompt_mean, MAX_NEW_TOKENS / 2, MAX_NEW_TOKENS), threads=args.threads)
    estimate.measure()
    print(f"before the blocks: {estimate.summary()}", flush=True)

    problem = trl_problem()
    times: dict[tuple[str, str], list[float]] = {}
    responses: dict[str, list[float]] = {"mean": [], "max": []}
    for round_index in range(args.rounds):
        for dtype in args.dtypes:
            if problem is None:
                block = run_worker("trl", args, data=data_path, out=os.path.join(work, f"trl{round_index}{dtype}"),
                                   seed=round_index, dtype=dtype)
                times.setdefault(("TRL", dtype), []).extend(block[1:])
                print(f"round {round_index}: TRL {dtype} step times {[round(t, 1) for t in block]} s", flush=True)
            block = run_worker("skyrl", args, data=data_path, out=os.path.join(work, f"skyrl{round_index}{dtype}"),
                               seed=round_index, dtype=dtype)
            times.setdefault(("skyrl", dtype), []).extend(block["times"][1:])
            responses["mean"] += block["response_mean"][1:]
            responses["max"] += block["response_max"][1:]
            print(f"round {round_index}: skyrl {dtype} step times {[round(t, 1) for t in block['times']]} s "
                  f"(mean response {statistics.mean(block['response_mean']):.1f} tokens)", flush=True)

    roofline = Roofline(step_gemms(args.model_dir, prompt_mean, statistics.mean(responses["mean"]),
                                   statistics.mean(responses["max"])), threads=args.threads)
    roofline.rates.update(estimate.rates)  # the shapes they share keep the best of both measurements
    roofline.measure()
    print(f"load after the blocks: {uptime()}")
    print(f"prompts {prompt_mean:.1f} tokens, responses {statistics.mean(responses['mean']):.1f} tokens on average "
          f"(skyrl's samples; TRL samples the same model); {roofline.summary()}")
    # skyrl trains each prompt once for its rows: less work than the rows' (TRL's), with its own floor.
    shared = Roofline(step_gemms(args.model_dir, prompt_mean, statistics.mean(responses["mean"]),
                                 statistics.mean(responses["max"]), shared_prompts=True), threads=args.threads)
    shared.rates.update(roofline.rates)
    shared.measure()
    print(f"skyrl's own work (each prompt trained once for its {SAMPLES_PER_PROMPT} rows): {shared.summary()}")
    medians = {key: statistics.median(values) for key, values in times.items()}
    for (side, dtype), seconds in sorted(medians.items()):
        print(roofline.achieved(f"{side:5s} {dtype:8s} median step", seconds, dtype))
        if side == "skyrl":
            print(shared.achieved(f"skyrl {dtype:8s} median step against its own work", seconds, dtype))

    skyrl32 = medians[("skyrl", "float32")]
    floor32 = roofline.floor("float32")
    print(f"skyrl fp32 step / fp32 floor: {skyrl32 / floor32:.2f}x (target <= 1.2x; the floor of the rows' work, "
          f"TRL's); {skyrl32 / shared.floor('float32'):.2f}x the floor of skyrl's own work")
    if problem is not None:
        print(f"TRL not measured: {problem}")
        print(f"median step time: skyrl {skyrl32:.2f} s, TRL not measured ({problem.split(':')[0]}); ratio n/a")
        return
    trl32 = medians[("TRL", "float32")]
    print(f"fp32 ratio skyrl/TRL: {skyrl32 / trl32:.3f} (skyrl {skyrl32:.2f} s, TRL {trl32:.2f} s)")
    if "bfloat16" in args.dtypes:
        skyrl16 = medians[("skyrl", "bfloat16")]
        trl_best = min(("float32", "bfloat16"), key=lambda d: medians[("TRL", d)])
        print(f"bf16 ratio skyrl bf16 / TRL fastest ({trl_best}): {skyrl16 / medians[('TRL', trl_best)]:.3f} "
              f"(skyrl {skyrl16:.2f} s, TRL {medians[('TRL', trl_best)]:.2f} s)")
        print(f"skyrl bf16 / TRL fp32: {skyrl16 / trl32:.3f} (target <= 0.25)")


if __name__ == "__main__":
    main()

"""Checkpoints of a run: the backend's state plus the trainer's, written atomically, read without pickle.

Layout (``<output_dir>/checkpoints/``)::

    step_000004/
        backend/             whatever TrainingBackend.save_checkpoint writes (weights, optimizer, RNG)
        critic/              only with algorithm.critic.enabled: the value model, its optimizer and
                             step count (``skyrl_core.trainer.critic``)
        trainer_state.json   format, step, data position, KL coefficient, metrics history
        rng.safetensors      this process's Python, NumPy and torch RNG states (``skyrl_core.state_file``)
    latest                   the name of the newest complete checkpoint

Guarantees (see docs/training.md, "Checkpoints"):
- a checkpoint directory appears only once complete (written under a temporary name, then renamed),
  so a run killed while checkpointing leaves the previous checkpoint as the latest; the temporaries
  such a kill leaves are removed when the next run starts in that directory;
- reading a checkpoint runs no code: JSON and safetensors only, never pickle;
- files and directories get the modes ordinary files get (0644 / 0755 under the usual umask 022);
- a checkpoint of another format is refused with a message saying which format it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from skyrl_core.directories import publish_directory, recover_replaced
from skyrl_core.rng_state import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from skyrl_core.interfaces import TrainingBackend
    from skyrl_core.trainer.critic import Critic

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.safetensors"
BACKEND_DIR = "backend"
CRITIC_DIR = "critic"
# 2: RNG state in safetensors + JSON (format 1 pickled it in rng.pt, which resuming would execute).
FORMAT = 2

# What an interrupted atomic write leaves: ``.NAME.tmp-XXXX`` (a temporary directory or file being
# written, here and in ``RankDriver._write_atomically``) and ``NAME.old-XXXXXXXX`` (a replaced one).
_STALE = re.compile(r"\..+\.tmp(-[A-Za-z0-9_]+)?")
# An old copy moved aside by an overwrite (skyrl_core.directories; ``.old-<hex>`` by earlier versions)
_ASIDE = re.compile(r"(.+)(\.replaced|\.old-[0-9a-f]{8})")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(output_dir: str, step: int, backend: TrainingBackend, trainer_state: dict[str, Any],
                    critic: Any = None) -> str:
    """Write the checkpoint of ``step`` (with ``critic``'s state if given) and point ``latest`` at
    it; return its path."""
    from skyrl_core.state_file import save_state

    root = os.path.join(os.path.abspath(output_dir), CHECKPOINTS_DIR)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, checkpoint_name(step))
    tmp = tempfile.mkdtemp(prefix=f".{checkpoint_name(step)}.tmp-", dir=root)
    try:
        backend.save_checkpoint(os.path.join(tmp, BACKEND_DIR))
        if critic is not None:
            critic.save(os.path.join(tmp, CRITIC_DIR))
        save_state(os.path.join(tmp, RNG_FILE), capture_rng_state())
        with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "step": step, **trainer_state}, f, sort_keys=True)
        apply_ordinary_modes(tmp)
        publish_directory(tmp, final)  # (an old copy of this step is deleted only once this one is in place)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = os.path.join(root, f".{LATEST_FILE}.tmp")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(checkpoint_name(step) + "\n")
    os.replace(pointer, os.path.join(root, LATEST_FILE))
    return final


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory ``path`` names: a checkpoint itself, or a run directory (or its
    ``checkpoints/``) whose ``latest`` checkpoint is taken."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    for root in (path, os.path.join(path, CHECKPOINTS_DIR)):
        latest = os.path.join(root, LATEST_FILE)
        if os.path.isfile(latest):
            with open(latest, encoding="utf-8", errors="replace") as f:
                candidate = os.path.join(root, os.path.basename(f.read().strip()))
            if os.path.isfile(os.path.join(candidate, STATE_FILE)):
                return candidate
    raise FileNotFoundError(
        f"trainer.resume={path!r} is neither a checkpoint (a directory with {STATE_FILE}) nor a run "
        f"directory with {CHECKPOINTS_DIR}/{LATEST_FILE}"
    )


def read_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint ``path``; ``ValueError`` naming the format if it is not this
    trainer's."""
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {STATE_FILE} is unreadable ({exc})") from None
    found = state.get("format") if isinstance(state, dict) else None
    if found != FORMAT:
        hint = (" (format 1 stored RNG state with pickle, which resuming would execute; it cannot be "
                "read safely; an FSDP checkpoint's backend/ directory is a Hugging Face model a new run can "
                "start from with model.path)"
                if found == 1 else "")
        raise ValueError(f"{path}: trainer checkpoint format {found!r}, this trainer reads format {FORMAT}{hint}")
    return state


def load_checkpoint(path: str, backend: TrainingBackend, critic: Critic | None = None) -> dict[str, Any]:
    """Restore the backend (and ``critic`` if given) and this process's RNG from checkpoint ``path``;
    return the trainer state."""
    from skyrl_core.state_file import load_state

    state = read_trainer_state(path)
    rng = load_state(os.path.join(path, RNG_FILE))  # before the backend: a bad file changes nothing
    if critic is not None:  # before the backend: a checkpoint without a critic changes nothing
        critic.load(os.path.join(path, CRITIC_DIR))
    backend.load_checkpoint(os.path.join(path, BACKEND_DIR))
    restore_rng_state(rng)
    return state


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete what interrupted atomic writes left in ``run_dir`` and its ``checkpoints/``, and put
    back an old copy an interrupted overwrite left aside where the new one never arrived; return
    the paths removed. Only names this module and the backend driver create are touched."""
    removed = []
    for root in (run_dir, os.path.join(run_dir, CHECKPOINTS_DIR)):
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            aside = _ASIDE.fullmatch(name)
            if aside is not None:
                # put back where the new copy never arrived, else deleted
                if recover_replaced(os.path.join(root, aside.group(1)), os.path.join(root, name)) == "removed":
                    removed.append(os.path.join(root, name))
                continue
            if not _STALE.fullmatch(name):
                continue
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(path)
    return removed


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and put it back at once)
    os.umask(mask)
    return mask


def apply_ordinary_modes(top: str) -> None:
    """Give ``top`` and everything under it the modes ``open``/``mkdir`` give ordinary files
    (0644 / 0755 under umask 022): ``tempfile`` makes private 0700 / 0600 ones."""
    mask = _umask()
    dir_mode, file_mode = 0o777 & ~mask, 0o666 & ~mask
    os.chmod(top, dir_mode)
    for root, dirs, files in os.walk(top):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)

"""Head training on several processes: `accelerate launch --multi_gpu --num_processes N -m hf_spec.cli.main train
...` or `torchrun --nproc_per_node N -m hf_spec.cli.main train ...` (gloo on CPUs, NCCL on GPUs).

Every process holds the whole head and optimizer (a head is one decoder layer: nothing to shard) and walks the same
global schedule of token-budget batches. Each global batch is dealt out by rank (`items[rank::N]`); each process
weighs its loss by its share of the batch's loss positions, so the all-reduced SUM of the processes' gradients is
the gradient of the global batch's loss, as one process would compute it (up to float summation order). Every
process then takes the same optimizer step, and the heads stay identical without broadcasting weights. The main
process alone writes checkpoints, reports and the head folder, and shows progress bars and logs.

A checkpoint holds the global state (weights, optimizer, schedule position), so a run resumes with any number of
processes. One process (plain `hf-spec train`) goes through the same code with `Processes.single()`. The trainers
that share their work out: `train eagle`, `eagle3`, `lyanna` (`training/trainer.py`'s loop) and `exits` (its own).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Processes:
    """This process's place among the training processes.

    Args:
        rank / world: this process's index and the number of processes.
        accelerator: accelerate's `Accelerator` when several processes run (None for one).
    """

    rank: int = 0
    world: int = 1
    accelerator: object | None = None

    @classmethod
    def single(cls) -> Processes:
        return cls()

    @classmethod
    def start(cls) -> Processes:
        """The processes a launcher started (`torchrun`, `accelerate launch --multi_gpu`, MPI: gloo on CPUs, NCCL
        on GPUs), or one process without one."""
        launched = _launched_world()
        if launched <= 1:
            if _accelerate_cpu_without_mpi():
                raise ValueError(
                    "accelerate launch --cpu --num_processes N started ONE process: accelerate spawns several CPU "
                    "processes only through MPI (--mpirun_hostfile). Launch them with `torchrun --nproc_per_node N "
                    "-m hf_spec.cli.main train ...` or `accelerate launch --multi_gpu --num_processes N -m "
                    "hf_spec.cli.main train ...` (gloo on CPUs), or drop --num_processes to train in one process"
                )
            return cls.single()
        from accelerate import Accelerator

        # the launcher's settings (mixed precision, the process group); gloo where there is no GPU
        cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in (
            "1",
            "true",
        )
        accelerator = Accelerator(device_placement=False, cpu=cpu)
        return cls(accelerator.process_index, accelerator.num_processes, accelerator)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[int]) -> tuple[list[int], bool]:
        """`(this process's items of a global batch, whether they count)`: every N-th item from its rank; a
        process left without items computes the first item with weight 0 (it still joins the gradient sum)."""
        mine = list(items[self.rank :: self.world])
        return (mine, True) if mine else ([items[0]], False)

    def total(self, value: float) -> float:
        """`value` summed over the processes."""
        if self.world == 1:
            return float(value)
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self._device())
        return float(self.accelerator.reduce(tensor, reduction="sum"))

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace every process's gradients by their sum over the processes (one all-reduce of a flat buffer)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        flat = self.accelerator.reduce(flat, reduction="sum")
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
            offset += n

    def barrier(self) -> None:
        if self.world > 1:
            self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """The main process runs the block first (it fills the caches: answers, features), the others after it
        (they read them)."""
        if self.world == 1:
            yield
            return
        with self.accelerator.main_process_first():
            yield

    def _device(self) -> torch.device:
        return self.accelerator.device


@functools.lru_cache(maxsize=1)
def current_processes() -> Processes:
    """This run's `Processes`, started once per process (the trainer and the CLI that saves its results ask the
    same question)."""
    return Processes.start()


def check_single_process(what: str) -> None:
    """Refuse a launch of several processes for a command that runs in one (each would do all the work and write
    the same files)."""
    if _launched_world() > 1:
        raise ValueError(
            f"{what} runs in one process: start it without accelerate launch / torchrun (the head trainers "
            "`train eagle`, `eagle3`, `lyanna`, `exits` share their work out)"
        )


def _launched_world() -> int:
    """The number of processes a launcher says it started (1 without one)."""
    names = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    return max(int(os.environ.get(name, "1") or 1) for name in names)


def _accelerate_cpu_without_mpi() -> bool:
    """`accelerate launch --cpu --num_processes N` (N > 1) without MPI: accelerate sets the rendezvous address for
    the N processes it expects MPI to start, and runs this one alone."""
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    return cpu and "MASTER_ADDR" in os.environ and "RANK" not in os.environ


def share_of_positions(batch: dict[str, torch.Tensor], counts: bool, processes) -> float:
    """This process's share of the global batch's loss positions (answer tokens with two predecessors, the
    positions `Unroll.mask` counts); 1.0 with one process."""
    if processes.world == 1:
        return 1.0
    ok = batch["valid"] & batch["response_mask"].bool()
    mine = float(ok[:, 2:].sum()) if counts else 0.0
    return mine / max(processes.total(mine), 1.0)


def global_values(
    loss: float, accs: list[float], parts: dict[str, float], weight: float, processes
) -> tuple[float, list[float], dict[str, float]]:
    """The global batch's loss, accuracies and loss parts from each process's, weighted by its share."""
    if processes.world == 1:
        return loss, accs, parts
    values = torch.tensor([loss, *accs, *parts.values()], dtype=torch.float64) * weight
    out = (
        processes.accelerator.reduce(values.to(processes.accelerator.device), reduction="sum").cpu().tolist()
    )
    return out[0], out[1 : 1 + len(accs)], dict(zip(parts, out[1 + len(accs) :], strict=True))

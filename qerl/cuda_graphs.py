"""What a failed CUDA-graph capture leaves behind, undone (shared by the kernel tuner and the decoder).

Plain torch, no Triton: imported on every machine (``qerl.rollout.decoders``), and lazily by
``kernels/_launch.py``'s tuner.
"""

import torch


def abandon_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Undo what ``torch.cuda.graph`` leaves behind when the capture fails inside it (``capture_end``
    raises before it ends the allocator's routing to the graph's private pool, before it marks the
    CUDA RNG as no longer capturing, and the capture stream stays current): otherwise later
    allocations land in a dead pool (the allocator asserts at exit, ``captures_underway.empty()``)
    and the next random op anywhere (vLLM's sampler) fails with "Offset increment outside graph
    capture"."""
    torch.cuda.set_stream(stream)
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, graph.pool())
        torch._C._cuda_releasePool(device, graph.pool())
    except RuntimeError:  # capture_end did get that far: nothing left to undo
        pass
    # A tiny capture that succeeds runs the RNG's capture prologue/epilogue once more and so clears
    # its "capturing" flag (not reachable from Python otherwise).
    reset = torch.cuda.CUDAGraph()
    with torch.cuda.graph(reset):
        torch.empty(1, device=device).uniform_()
    del reset

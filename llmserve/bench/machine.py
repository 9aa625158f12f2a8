"""What a benchmark ran on: the CPU and the SIMD flags kernels dispatch on, and which
compute path of the engine (dtype, quantization, KV-cache dtype) it measured.

Every bench command prints `format_machine()` above its table and stores `machine_info()`
in its JSON, so a number is never read apart from the hardware (and the instruction set
PyTorch chose) that produced it. `bench serve` reports the machine running the client.
"""

from typing import TYPE_CHECKING, Any

import torch

from llmserve import cpu_info

if TYPE_CHECKING:
    from llmserve.llm import LLM

# The flags that decide which kernels run (one list, cpu_info.KERNEL_FLAGS)
CPU_FLAGS = cpu_info.KERNEL_FLAGS


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The `CPU_FLAGS` this CPU has (or the /proc/cpuinfo text `cpuinfo` names), in
    `CPU_FLAGS` order; [] where the platform does not say."""
    present = (cpu_info.cpu_features() if cpuinfo is None
               else cpu_info.features_from_cpuinfo(cpuinfo))
    return [flag for flag in CPU_FLAGS if flag in present]


def machine_info() -> dict[str, Any]:
    """CPU model, flags, PyTorch's CPU capability, threads, and the GPU if there is one."""
    info: dict[str, Any] = {
        "cpu": cpu_info.cpu_model_name(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_level": kernel_level(),
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return info


def kernel_level() -> str | None:
    """The instruction-set level of the native kernels this process runs ("avx2",
    "avx512+vnni", ...; None without them); where it has not loaded them (a load generator),
    the level LLMSERVE_CPU_ISA asks for, without building anything."""
    from llmserve.kernels import level_of, native, requested_level

    if native.cache_info().currsize:
        lib = native()
        return None if lib is None else level_of(lib)
    try:
        level, extensions = requested_level()
    except ValueError:
        return None
    return f"{level} (requested{', with extensions' if extensions else ''})"


def format_machine(info: dict[str, Any] | None = None, what: str = "machine") -> str:
    """One line for a table header: CPU, flags, torch's capability, threads (and GPU)."""
    info = info or machine_info()
    flags = " ".join(info["cpu_flags"]) or "none known"
    line = (f"{what}: {info['cpu']}; flags: {flags}; llmserve kernels "
            f"{info.get('kernel_level') or 'none'}; torch cpu capability "
            f"{info['torch_cpu_capability']}; {info['num_threads']} threads")
    return line + (f"; gpu: {info['gpu']}" if info["gpu"] else "")


def effective_quantization(llm: "LLM") -> str | None:
    """The quantization method the loaded linear layers run (None: float weights).

    What the loader reports when it says (`loaded.quantization`: a requested "auto" has
    become a method or None by then), else what the engine was asked for.
    """
    engine = llm.engine
    if hasattr(engine.loaded, "quantization"):
        method = engine.loaded.quantization
    else:
        method = getattr(engine.config, "quantization", None)
    return None if method == "none" else method


def path_info(llm: "LLM") -> dict[str, Any]:
    """The engine's compute path, for a report: dtype, quantization, KV dtype, device."""
    engine = llm.engine
    kv_dtype = getattr(engine, "kv_cache_dtype", engine.dtype)
    return {"dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": effective_quantization(llm),
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
            "device": str(engine.device)}


def format_path(path: dict[str, Any]) -> str:
    return (f"path: dtype {path['dtype']}, quantization {path['quantization'] or 'none'}, "
            f"KV cache {path['kv_cache_dtype']}, device {path['device']}")

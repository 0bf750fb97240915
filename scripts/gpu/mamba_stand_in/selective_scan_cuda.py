"""A stand-in for mamba_ssm's CUDA extension on the GPU machine, where mamba_ssm is installed from a wheel built without
it (MAMBA_SKIP_CUDA_BUILD: no compiling there). mamba_ssm imports the extension at its own import; megatron-core's
Mamba-2 layers never call it (their scan and gated norm are Triton kernels)."""


def __getattr__(name: str) -> object:
    raise AttributeError(f"selective_scan_cuda.{name}: mamba_ssm was built without its CUDA extension")

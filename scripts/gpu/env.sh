# Sourced by the chain and by single calls on the GPU machine: where deepflash (the current directory: the
# checkout, or /root/deepflash in the chain), the carried wheels and the caches live.
export PYTHONPATH=$PWD:/root/site
export DEEPFLASH_CACHE=${DEEPFLASH_CACHE:-/root/cache}
export PYTHONUNBUFFERED=1
deepflash() { python3 -m deepflash.cli "$@"; }
# multi-GPU machines: NVLink multicast stays off (the device README: it can take the host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

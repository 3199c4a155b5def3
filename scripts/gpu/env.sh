# Sourced by the chain: where deepflash, the wheels and the caches live on the GPU machine.
export PYTHONPATH=/root/deepflash:/root/site
export DEEPFLASH_CACHE=/root/cache
export PYTHONUNBUFFERED=1
# tokenizers' threads stay on: datagen encodes its prompts in one batched call (TOKENIZERS_PARALLELISM=false
# made its encode 1.4-1.9x slower on 2 CPUs, BENCHMARKS.md "Twenty-seventh GPU session")
deepflash() { python3 -m deepflash.cli "$@"; }
# multi-GPU machines: NVLink multicast stays off (the device README: it can take the host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Sourced by the chain: where deepflash, the wheels and the caches live on the GPU machine.
export PYTHONPATH=/root/deepflash:/root/site
export DEEPFLASH_CACHE=/root/cache
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
deepflash() { python3 -m deepflash.cli "$@"; }

# Sourced by the GPU scripts on the device machine (scripts/gpu_grpo/run.sh, scripts/gpu_learn/run.sh): the machine
# has torch and transformers but no network, so the wheels a call carried are installed into /tmp/site (its own
# torch stays), and final runs with /tmp/site and the given folders first on PYTHONPATH.
#   gpu_env WHEEL... -- FOLDER...     (exits the calling script with 3 if a wheel does not install)
gpu_env() {
  local wheels=() path=/tmp/site
  while [ $# -gt 0 ] && [ "$1" != -- ]; do wheels+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  for dir in "$@"; do path=$path:$dir; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || exit 3
  export PYTHONPATH=$path PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error FINAL_CACHE=/tmp/fc
  python3 -c "import torch, transformers, verl; print(torch.__version__, transformers.__version__, verl.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
}

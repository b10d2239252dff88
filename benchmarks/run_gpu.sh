#!/usr/bin/env bash
# The GPU benchmark in one command, needing nothing that is not in the repo:
#
#   benchmarks/run_gpu.sh [OUT_DIR]      # from anywhere; OUT_DIR defaults to $OUT or benchmarks/results
#
# Needs a Python with jax (with CUDA), optax, flax and matplotlib; jmp is taken
# from .whl/jmp-*.whl when it is not installed (pure Python, carry it along),
# and its variant is skipped when neither is there. Runs the whole benchmark
# twice: with XLA's defaults (lax.cond copies the predicate to the host and
# waits for it every step) and with command-buffer conditionals, which keep
# the branch on the device. Writes gpu.json/png, gpu-cmdbuf.json/png and
# BENCHMARKS-gpu.md (both result blocks) into OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$out_dir"
py="${PYTHON:-python3}"
if ! "$py" -c "import jmp" 2>/dev/null && compgen -G ".whl/jmp-*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --target /tmp/jmp-site .whl/jmp-*.whl
  export PYTHONPATH="/tmp/jmp-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c "import jax; print(jax.devices())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$py" -m benchmarks.run --out "$out_dir" --markdown "$out_dir/BENCHMARKS-gpu.md" "${@:2}"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+CONDITIONAL" \
  "$py" -m benchmarks.run --out "$out_dir" --markdown "$out_dir/BENCHMARKS-gpu.md" --tag cmdbuf "${@:2}"

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
# the branch on the device; then the GPU-size LM (186M parameters) alone, with
# the finiteness-read floor (--gpu-size); then the bfloat16-parameter benchmark
# (benchmarks/low_precision_params.py: final loss, bytes per parameter and step
# time of master weights (a full copy or a 16-bit remainder), stochastic rounding,
# 8-bit moments and Kahan against plain bfloat16; the optimizer update alone on
# 4M parameters (4 matrices of 1024 square) against bare Adam and master_weights;
# bytes per parameter of the LM and of GPT-2 small's shapes),
# autocast against hand casts and the model's own dtype= on the 186M LM
# (benchmarks/autocast_bench.py: peak temporary memory and step time),
# and fp8 autocast (benchmarks/fp8_autocast_bench.py --gpu: single GEMMs up to
# 4096x8192x16384 and the 186M LM step, bare bfloat16 vs autocast bfloat16 vs
# fp8 tensorwise/rowwise, with the count of cuBLASLt fp8 GEMMs XLA emitted).
# Writes gpu.json/png, gpu-cmdbuf.json/png, gpu-large.json, BENCHMARKS-gpu.md
# (three result blocks), dispatch.txt (Python per dispatched call),
# low_precision_params-gpu.json/md, autocast.json/md and fp8.json/md into OUT_DIR.
# PARTS picks some of "default cmdbuf large dispatch lowprec update autocast fp8" (each
# under 10 minutes; "update" is not in the default list, whose "lowprec" holds it at 4M).
# Part "update" is the optimizer update alone at 16M and 256M parameters (4 matrices of
# 2048 and 8192 square; every variant of low_precision_params' update table: time vs
# bare Adam and master_weights, bytes held, bytes the compiled program accesses, the
# minimum), written as low_precision_params-gpu-update-16M/-256M.json/md.
# For the open issues' GPU figures first, in the order that keeps the most if a time
# limit cuts the run short (each part's files are written when it ends):
#   PARTS="update autocast default fp8" benchmarks/run_gpu.sh "$OUT"
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
md="$out_dir/BENCHMARKS-gpu.md"
for part in ${PARTS:-default cmdbuf large dispatch lowprec autocast fp8}; do
  case "$part" in
    default) "$py" -m benchmarks.run --out "$out_dir" --markdown "$md" --gpu-size \
      --only optimizer,train,skip "${@:2}" ;;
    cmdbuf) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+CONDITIONAL" \
      "$py" -m benchmarks.run --out "$out_dir" --markdown "$md" --gpu-size \
      --only optimizer,train,skip --tag cmdbuf "${@:2}" ;;
    # 10 variants of the 186M LM hold ~30 GB of params and optimizer state.
    large) XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-.9}" \
      "$py" -m benchmarks.run --out "$out_dir" --markdown "$md" --gpu-size --only large \
      --tag large "${@:2}" ;;
    dispatch) "$py" -m benchmarks.dispatch_overhead | tee "$out_dir/dispatch.txt" ;;
    autocast) "$py" -m benchmarks.autocast_bench --gpu-size --steps 100 \
      --out "$out_dir/autocast.json" | tee "$out_dir/autocast.md" ;;
    lowprec) "$py" -m benchmarks.low_precision_params --out "$out_dir" ;;
    update) for side in 2048:16M 8192:256M; do
        "$py" -m benchmarks.low_precision_params --only update --update-side "${side%%:*}" \
          --tag "update-${side##*:}" --out "$out_dir"
      done ;;
    fp8) "$py" -m benchmarks.fp8_autocast_bench --gpu --out "$out_dir/fp8.json" \
      | tee "$out_dir/fp8.md" ;;
    *) echo "unknown part $part (default, cmdbuf, large, dispatch, lowprec, update, autocast, fp8)" >&2
      exit 2 ;;
  esac
done

#!/bin/bash
# Issues 41 and 42 on the lent 16-core H200 host, one part per `run` (each well inside its 10-minute limit):
#   bash bench/device_session.sh resume7b $OUT [RUNS] [APPROACHES]   6.7B bf16 safetensors -> ZeRO-3 bf16 on the GPU,
#        against Transformers; the optimizer offloaded (Adam's fp32 state of 6.7B parameters does not fit beside
#        the weights on one card), 2 training steps after dsckpt's load
#   bash bench/device_session.sh curve $OUT LAYERS [DIM]   generate, then scaling, in one run (a run's files go
#        when the machine is given back)
#   bash bench/device_session.sh scaling $OUT LAYERS [DIM]   bench_scaling.py: 1, 2, 4, 8 processes against the disk
#   bash bench/device_session.sh s3 $OUT LAYERS [DIM]    bench_s3.py against a local moto server (wheels in .whl/s3/)
#   bash bench/device_session.sh async $OUT STAGE [MODES] [STEPS] [ROUNDS]   bench_async_save.py, 1.21B bf16 on the GPU
#   bash bench/device_session.sh gpu-tests $OUT [-k EXPR]    the GPU-marked tests (Lightning's own strategy among them)
#   bash bench/device_session.sh persist-loss $OUT    issue 54's open questions in one run (performance-log 37): the
#        copy engines, the persist beside a Python-bound thread in and out of process, nice 19 on the throughput
#   bash bench/device_session.sh paced $OUT    the paced device-to-host copies (performance-log 39): GPU test, throughput
#   bash bench/device_session.sh first-save $OUT STAGE [STEPS] [PAIRS]   issue 68 point 8: the first save's block with the pinned
#        buffers reserved after the first step (default) and allocated in the call (BENCH_NO_RESERVE), alternated
#   bash bench/device_session.sh trust $OUT STAGE [EVERY] [gpu-tests]   issue 68, one stage's figures in one run: the first
#        save with its buffers reserved and allocated in the call (the steps during the reservation beside it), then
#        the steady block and throughput at a save every EVERY steps (default 30), paired, against rounds without a save
#   bash bench/device_session.sh engines $OUT STAGE WRITER [ROUNDS] [STEPS]   issue 68: DeepSpeed's own engines (WRITER
#        fast: the FastPersist writer, decoupled: its writer process) alternating with dsckpt's background save, in one
#        run; builds the async_io op first (libaio unpacked in .whl/libaio/, ninja from .whl/)
# DeepSpeed 0.19.8, einops and isal (dsckpt's own dependency: without it every CRC-32 is zlib's, ~10x slower) travel
# as wheels in .whl/ (installed to /tmp/site); an image without pydantic and hjson needs theirs too (pydantic_core
# built for the host's Python: `pip download --python-version 3.12 --only-binary=:all:`).
part=${1:?part}; out=${2:?OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nproc; free -g | head -2; df -h . /tmp | tail -2
case $part in
  resume7b)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 bench/bench_gpu_resume.py --out /tmp/r7b --dim 4096 --layers 32 --vocab 32000 --file-dtype bf16 \
      --formats safetensors --steps 2 --runs ${3:-1} --approaches ${4:-dsckpt,transformers} --offload pageable 2>&1 | tail -12
    cp /tmp/r7b/report.md $out/resume7b.md; cp /tmp/r7b/report.json $out/resume7b.json
    cp /tmp/r7b/*.stderr $out/ 2>/dev/null; rm -rf /tmp/r7b ;;
  scaling)
    BENCH_DIM=${4:-1024} python3 bench/bench_scaling.py --layers $3 --procs 1 2 4 8 --runs ${5:-2} --out /tmp/scaling
    cp /tmp/scaling/*.json /tmp/scaling/*.md $out/ ;;
  s3)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/s3/*.whl || exit 1
    BENCH_DIM=${4:-1024} python3 bench/bench_s3.py --layers $3 --runs 3 --json $out/s3.json 2>&1 | tail -8 | tee $out/s3.md ;;
  async)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 bench/bench_async_save.py --nproc 1 --stage $3 --precision bf16 --dim 2048 --layers 24 --rounds ${6:-3} \
      --modes ${4:-stock,async,async-torch,none} --steps-between ${5:-3} --out /tmp/async --json $out/async-z$3.json 2>&1 \
      | grep -v -i warn | tail -7 | tee $out/async-z$3.txt ;;
  gpu-tests)
    shift 2
    timeout 500 python3 -m pytest -q -m gpu tests/test_trainer_flows.py tests/test_async_save.py "$@" 2>&1 | grep -v -i warn | tail -60 \
      | tee $out/gpu_tests.txt ;;
  persist-loss)
    nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -i "^thread\|^core\|^socket\|model name"
    PROBE_GB=8 timeout 60 python3 bench/probe_copy_engine.py 2>&1 | grep -v -i warn | tee $out/copy_engine.txt
    PROBE_GB=2 timeout 150 python3 bench/probe_persist_gil.py 2>&1 | tee $out/persist_gil.txt
    timeout 300 python3 bench/bench_async_save.py --nproc 1 --stage 3 --precision bf16 --dim 2048 --layers 24 \
      --rounds 2 --modes async,async-nice19,none --steps-between 30 --paired --out /tmp/async \
      --json $out/async-nice.json 2>&1 | grep -v -i warn | tail -8 | tee $out/async-nice.txt ;;
  paced)  # issue 54, round 24: the GPU test of the paced copies, then the throughput, async against no save, paired
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 150 python3 -m pytest -q -m gpu tests/test_async_save.py -k background_save_from_gpu 2>&1 | grep -v -i warn \
      | tail -5 | tee $out/gpu_tests.txt
    timeout 280 python3 bench/bench_async_save.py --nproc 1 --stage 3 --precision bf16 --dim 2048 --layers 24 \
      --rounds 2 --modes async,none --steps-between 30 --paired --out /tmp/async \
      --json $out/async-paced.json 2>&1 | grep -v -i warn | tail -8 | tee $out/async-paced.txt ;;
  first-save)
    nvidia-smi --query-gpu=name --format=csv,noheader
    for pair in $(seq ${5:-1}); do for control in "" 1; do
      BENCH_NO_RESERVE=$control timeout 140 python3 bench/bench_async_save.py --nproc 1 --stage $3 --precision bf16 \
        --dim 2048 --layers 24 --rounds 1 --modes async --steps-between ${4:-30} --out /tmp/async \
        --json $out/first-save-z$3-${control:-reserved}-$RANDOM.json 2>&1 | grep -v -i warn | grep -i "first\|blocked" \
        | tee -a $out/first-save-z$3.txt
    done; done ;;
  trust)
    stage=$3; every=${4:-30}; model="--nproc 1 --stage $stage --precision bf16 --dim 2048 --layers 24 --out /tmp/async"
    nvidia-smi --query-gpu=name --format=csv,noheader
    [ "$5" = gpu-tests ] && timeout 90 python3 -m pytest -q -m gpu tests/test_async_save.py 2>&1 | grep -v -i warn \
      | tail -5 | tee $out/gpu_tests.txt
    for control in "" 1; do
      name=reserved; [ -n "$control" ] && name=in-call
      BENCH_NO_RESERVE=$control timeout 130 python3 bench/bench_async_save.py $model --rounds 1 --modes async \
        --steps-between 30 --json $out/first-save-z$stage-$name.json 2>&1 \
        | grep -v -i warn | grep -i "first\|no save" | tee -a $out/first-save-z$stage.txt
    done
    timeout 250 python3 bench/bench_async_save.py $model --rounds 3 --modes async,none --steps-between $every --paired \
      --json $out/steady-z$stage.json 2>&1 | grep -v -i warn | tail -8 | tee $out/steady-z$stage.txt ;;
  engines)
    aio=$PWD/.whl/libaio/usr; lib=$aio/lib/x86_64-linux-gnu
    export CPATH=$aio/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib:$LD_LIBRARY_PATH CFLAGS="-I$aio/include" \
      LDFLAGS="-L$lib" TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=$PWD/bench/cache/ext PATH=/tmp/site/bin:$PATH
    nvidia-smi --query-gpu=name --format=csv,noheader
    start=$(date +%s)
    python3 -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load()" 2>&1 | grep -v -i warn | tail -3
    echo "async_io op ready in $(( $(date +%s) - start )) s" | tee $out/engines-build.txt
    BENCH_DS_WRITER=$4 timeout 420 python3 bench/bench_async_save.py --nproc 1 --stage $3 --precision bf16 --dim 2048 \
      --layers 24 --rounds ${5:-2} --modes stock,async --steps-between ${6:-5} --out /tmp/async \
      --json $out/engines-z$3-$4.json 2>&1 | grep -v -i warn | tail -9 | tee $out/engines-z$3-$4.txt ;;
  curve)
    bash $0 generate $out $3 ${4:-1024} && bash $0 scaling $out $3 ${4:-1024} ${5:-2} ;;
  generate)  # the checkpoint only (cached under bench/cache/ while the machine is held), trained on CPU ranks
    export CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu
    start=$(date +%s)
    BENCH_DIM=${4:-1024} python3 -c "import sys; sys.path.insert(0, 'bench'); import bench_consolidate as b; print(b.generate(3, $3))"
    echo "generated in $(( $(date +%s) - start )) s"; du -sh bench/cache/* ;;
esac

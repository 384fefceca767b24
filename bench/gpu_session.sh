#!/bin/bash
# What one lent-GPU session runs for issue 25 (device budget is minutes: the most telling runs first).
#   bash bench/gpu_session.sh $OUT        (DeepSpeed installed or on PYTHONPATH)
# 1. bench_gpu_resume, one alternating round over .pt and .safetensors inputs: dsckpt (parallel reads),
#    dsckpt-serial (one read thread), Transformers' loader, the floor (bytes to the GPU, nothing else);
# 2. the GPU-marked resume tests; 3. a second bench round, if time is left.  Reports land in $1 as they finish.
# (2026-12-03: 1 and 2 ran, 3 was cut by the session's device budget; raw: bench/last_gpu_resume_run.md.)
out=${1:?usage: gpu_session.sh OUT}
work=/tmp/gpu_bench
python3 bench/bench_gpu_resume.py --out $work --runs 1 --approaches dsckpt,dsckpt-serial,transformers,floor 2>&1 | tail -14
cp $work/report.md $out/resume_round1.md
timeout 150 python3 -m pytest -q -x -m gpu tests/test_runtime_resume.py 2>&1 | tail -4 | tee $out/gpu_tests.txt
python3 bench/bench_gpu_resume.py --out $work --runs 1 --approaches floor,transformers,dsckpt-serial,dsckpt 2>&1 | tail -10
cp $work/report.md $out/resume_round2.md

#!/bin/bash
# What one lent-GPU session runs for issue 25 (device budget is minutes: the most telling runs first).
#   bash bench/gpu_session.sh $OUT [rounds]   (DeepSpeed installed or on PYTHONPATH)
# 1. the CLI's own flows on the GPU: `train/resume --nproc 1` (dsckpt's launcher, no torchrun), bf16 ZeRO-3,
#    save, consolidate, full-weights resume with --check, reshard 1 -> 1 and a resume from it;
# 2. the GPU-marked tests;
# 3. bench_gpu_resume rounds over .pt and .safetensors inputs, the order of approaches reversed each round:
#    dsckpt (parallel reads), dsckpt-serial (one read thread), Transformers' loader, the floor (bytes to the
#    GPU, nothing else).  Reports land in $1 as they finish.
out=${1:?usage: gpu_session.sh OUT [rounds]}
rounds=${2:-2}
work=/tmp/gpu_bench
ck=/tmp/gpu_flow
set -o pipefail
{
  rm -rf $ck && mkdir -p $ck
  python3 -m dsckpt train --stage 3 --nproc 1 --precision bf16 --steps 3 --save-dir $ck/run &&
  python3 -m dsckpt inspect $ck/run &&
  python3 -m dsckpt consolidate $ck/run $ck/model.safetensors --verify &&
  python3 -m dsckpt resume --full-weights $ck/model.safetensors --stage 3 --nproc 1 --precision bf16 --check &&
  python3 -m dsckpt resume --full-weights $ck/model.safetensors --stage 3 --nproc 1 --precision bf16 --steps 2 --save-dir $ck/run &&
  python3 -m dsckpt reshard $ck/run $ck/run_z2 --world-size 1 --stage 2 &&
  python3 -m dsckpt resume $ck/run_z2 --nproc 1 --steps 2 --precision bf16 && echo "CLI FLOWS OK"
} > $out/cli_flows.txt 2>&1
tail -3 $out/cli_flows.txt
timeout 240 python3 -m pytest -q -m gpu tests 2>&1 | tail -6 | tee $out/gpu_tests.txt
order=dsckpt,dsckpt-serial,transformers,floor
for r in $(seq 1 $rounds); do
  python3 bench/bench_gpu_resume.py --out $work --runs 1 --approaches $order 2>&1 | tail -10
  cp $work/report.md $out/resume_round$r.md
  order=$(echo $order | tr , '\n' | tac | paste -sd, -)
done

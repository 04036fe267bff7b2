#!/usr/bin/env bash
# Rebuilds every committed table and figure from the committed records (no
# training: each command is a --report_only), then the claims table and the
# pages that copy them:  scripts/reports.sh [python]
# A report shows only the models, seeds and grid its flags name, so each
# command carries the flags of the runs it reports (a --tune report the
# recorded --lrs, in their order).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python}"
R=experiments/results
run() { echo "+ $*" >&2; "$PY" "$@" > /dev/null; }

run experiments/glue_from_scratch.py --scale=small --report_only --out=$R/glue_from_scratch
run experiments/glue_from_scratch.py --scale=small --tune --report_only \
    --lrs=1e-3,3e-3,1e-2,3e-2,3e-4,1e-1,3e-1 --seeds=0,1,2,3,4 --budget_check=500 \
    --out=$R/glue_from_scratch
run experiments/nli_splits.py --report_only --out=$R/nli_splits
run experiments/nli_splits.py --tune --report_only --tasks=qnli \
    --models=hypermixer,attention,mlp_mixer --lrs=1e-3,3e-3,1e-2,3e-4,1e-4,3e-5 \
    --seeds=0,1,2,3,4 --budget_check=500 --out=$R/nli_splits
run experiments/nli_splits.py --tune --report_only --tasks=snli \
    --models=hypermixer,attention,mlp_mixer --lrs=1e-4,3e-4,1e-3,3e-3,1e-2 \
    --seeds=0,1,2,3,4 --budget_check=500 --out=$R/nli_splits
run experiments/nli_splits.py --tune --report_only --tasks=mnli \
    --models=hypermixer,attention,mlp_mixer --lrs=1e-4,3e-4,1e-3,3e-3 \
    --seeds=0,1,2,3,4 --budget_check=500 --out=$R/nli_splits
run experiments/low_resource.py --scale=small --report_only --out=$R/low_resource
run experiments/low_resource.py --scale=small --tune --report_only --lrs=1e-3,3e-3,1e-2,3e-2 \
    --seeds=0,1,2,3,4 --budget_check=500 --out=$R/low_resource
run experiments/tuning_cost.py --scale=small --report_only --out=$R/tuning_cost
run experiments/tuning_cost.py --scale=small --carve --report_only --out=$R/tuning_cost
run experiments/pretrain_finetune.py --scale=small --report_only --out=$R/pretrain_finetune
run experiments/synthetic_data_efficiency.py --scale=small --report_only \
    --out=$R/synthetic_data_efficiency
run experiments/synthetic_data_efficiency.py --scale=small --tune --report_only \
    --lrs=1e-3,3e-3,1e-2,3e-2,1e-1,3e-1 --seeds=0,1,2,3,4 --out=$R/synthetic_data_efficiency
run experiments/synthetic_data_efficiency.py --scale=paper --report_only --seeds=0,1,2,3,4 \
    --out=$R/synthetic_data_efficiency_paper
run experiments/image_classification.py --scale=small --report_only --out=$R/image_classification
run experiments/image_classification.py --scale=small --tune --report_only \
    --families=gmlp,vit,mixer --lrs=0.0003,0.001,0.003,0.01 --seeds=0,1,2,3,4 \
    --budget_check=150,600 --out=$R/image_classification
run experiments/mlm_perplexity.py --scale=small --report_only --steps=6000 \
    --models=attention,gmlp --seeds=0 --out=$R/mlm_perplexity
run experiments/mlm_perplexity.py --scale=small --report_only \
    --models=attention,gmlp,amlp,attention_pre_ln,attention_sinusoidal,attention_deeper,attention_deepest \
    --out=$R/mlm_perplexity
run experiments/mlm_perplexity.py --scale=small --tune --report_only --lrs=3e-4,1e-3,3e-3,1e-2 \
    --models=attention,gmlp,amlp --seeds=0,1,2 --budget_check=1000 --out=$R/mlm_perplexity
run experiments/smlp_vs_moe.py --scale=small --report_only --ablations --out=$R/smlp_vs_moe
run experiments/smlp_vs_moe.py --scale=small --tune --report_only \
    --lrs=3e-4,1e-3,3e-3,1e-2,3e-2,1e-1 --seeds=0,1,2 --budget_check=500 \
    --out=$R/smlp_vs_moe
run experiments/causal_lm.py --scale=small --report_only --ablation_seeds=3 \
    --select_hyper_dims=16,32,64 --out=$R/causal_lm
run experiments/causal_lm.py --scale=small --tune --report_only --ablate_hyper_dims= \
    --ablate_chunks= --select_hyper_dims=16,32,64 --lrs=3e-4,1e-3,3e-3,1e-2,3e-2 --out=$R/causal_lm
run -m hypermixer_jax.experiment.claims
run scripts/docs_tables.py

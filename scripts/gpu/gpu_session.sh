#!/usr/bin/env bash
# GPU sessions for the evidence that tests/gpu does not hold (docs/verification.md; the families at the four-GPU layouts
# and their training steps: scripts/gpu/run_gpu_tests.sh), on the lent machines (Python 3.12, torch 2.11 with CUDA 13,
# no network). Files in /tmp there survive only while the machine is kept (about 30 s after a call), so the calls
# after `prepare` go back to back:
#
#   here:   bash scripts/gpu/gpu_session.sh prepare                  # wheels, and TE's core wheel in chunks (git-ignored)
#   there:  bash scripts/gpu/gpu_session.sh chunk N                  # a call each chunk prepare names, carrying build/tepc/N
#   there:  bash scripts/gpu/gpu_session.sh run 540 install te-export launch   # carrying .tebuild and .whl
#
# $MODEL replaces the MoE shape of profile and one-worker (a small one, e.g. qwen3-30b-a3b@1, to try them on
# the CPU box first).
#
# `run SECONDS STAGE...` runs the stages in order and stops starting work at SECONDS after its start, so that the
# call returns its results within the machine's 10 minutes a command. Each stage writes its results to $OUT as
# they come (train.jsonl, verify/results.jsonl, te_export.jsonl, a log per stage, the versions in
# session.log: at most 8 files come back from a call); a stage done in an earlier call of the same session is
# skipped (marker in /tmp/mconvert-session).
#   install     megatron-core 0.19.2 and Transformer Engine 2.20.2 into /tmp/site, flash-linear-attention and mamba_ssm
#               into /tmp/site-kernels (scripts/gpu/gpu_te_setup.sh install)
#   mcore       megatron-core 0.19.2 alone into /tmp/site (carry .whl): enough for bench
#   launch      Megatron-LM training steps through the train.sh a conversion writes (scripts/gpu/gpu_train.py --launcher
#               train.sh), on two GPUs
#   verify-mla  the same for GLM-4.5-Air and DeepSeek-V3, cut to their first dense and first MoE layer
#   train-mla   on one GPU: Megatron-LM training steps from DeepSeek-V3 and GLM-4.5-Air cuts (hidden 2048, 32 experts;
#               MTP=1: with their multi-token prediction layers)
#   verify-mla-bf16  the same cuts verified under TE in bf16
#   kimi        on one GPU: Kimi-K2 as released (2 layers, 32 experts): verify --spec te at real width, and
#               Megatron-LM training steps (hidden 2048) with the YaRN setting its flags cannot carry
#   gpt-oss     on one GPU: gpt-oss-20b's first two layers: verify --spec te at real width, and Megatron-LM training
#               steps with 8 of its experts
#   gpt-oss-mxfp4  on one GPU: gpt-oss-20b's first two layers stored in MXFP4 as on the hub, verified under TE
#   gdn-kernels on one GPU: Qwen3-Next verified in fp32 with each side on fla's kernels or on PyTorch (gdn_kernels.py)
#   minimax     on one GPU: MiniMax-M2.7's first two layers (q/k norms across heads from mconvert's --spec layer spec)
#               with 32 of its 256 experts: verify --spec te at real width at TP 1 from a TP 2 x EP 2 save, and
#               Megatron-LM training steps (hidden 2048, 16 experts)
#   qwen-gdn-verify  on one GPU: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (gated delta-net) cut to 4 layers at real width:
#               verify --spec te at TP 1 as written and from TP 2 x EP 2 and PP 2 saves (after install: fla)
#   qwen-gdn-train  the same families' Megatron-LM training steps on one GPU
#   dsa-verify  on one GPU: DeepSeek-V3.2 and GLM-5.1 (sparse attention) cut to a dense and an MoE layer at real
#               width: verify --spec te at TP 1 as written and from TP 2 x EP 2 and TP 2 x PP 2 saves
#   dsa-train   their Megatron-LM training steps on one GPU (hidden 2048, 32 experts, top-k 64)
#   hybrid      on one GPU: Megatron-LM's HybridModel training steps from mconvert's hybrid checkpoints (dense, MLA
#               with MoE and MTP, gated delta-net, sparse attention) and from GPT checkpoints with HYBRID_ARGS
#   hybrid-verify  on one GPU: mconvert verify --spec te of hybrid checkpoints (HybridModel, megatron-core alone) at real
#               width, written at TP 2 / EP 2 and run at TP 1: MLA with a dense first layer and MoE, gated delta-net,
#               sparse attention, sliding windows with sinks (after install: fla)
#   peers       on one GPU host: Megatron-Bridge, ms-swift and mbridge beside mconvert, both ways, timed whole, tensor
#               for tensor (scripts/gpu/gpu_peers.py; wheels: peers_setup.sh prepare, carried by peer-wheels and this call)
#   peers-new   on one GPU host: the same for what peers left: ms-swift on the DeepSeek-V3 cut, then gpt-oss, Qwen3-Next,
#               Nemotron-H, Qwen3.5-MoE, DeepSeek-V3.2, GLM-5.1, MiniMax-M2.7 and Qwen3.5 cut small, each with the peers
#               that convert it; resumable over calls (results in $OUT/peers-new/peers.jsonl)
#   fsdp        on one GPU: Megatron-LM training steps under Megatron-FSDP and FSDP2 (from torch_dist conversions,
#               and from random init saving fsdp_dtensor and torch_dcp) of test-sized models (dense, MoE, MLA with
#               MTP); their HF configs, tokens, losses and --lr 0 saves come back as fixtures
#   fsdp-in     on one GPU: Megatron-FSDP trained from hf-to-mcore --format fsdp_dtensor (dense, MoE, MLA with MTP),
#               beside DDP from torch_dist and an injected fault (the conversion without its Adam step counts)
#   fsdp-in-launch  on one GPU: the train.sh of such a conversion, as a user runs it
#   fsdp2-dcp-in  on one GPU: FSDP2 saving torch_dcp from torch_dist conversions (--auto-detect-ckpt-format)
#   fsdp-dp2    on two GPUs: the FSDP saves at data-parallel size 2 kept as fixtures, and FSDP2 at data-parallel size 2
#               from a torch_dist conversion
#   fsdp-dp2-train  on two GPUs: FSDP2 at data-parallel size 2 with its lr 1e-4 run, and a Megatron-FSDP save at EP 2
#   fsdp-ep2    on two GPUs: that Megatron-FSDP save at EP 2 alone (a fixture, with its ranks' own experts)
#   start       the start of a small model's conversion (bf16 Qwen2.5-0.5B whole) against cp -r, beside the older checkout
#               in $OLD_TREE (scripts/bench/bench_start.py; carry it, e.g. build/old made by `git archive COMMIT mconvert`)
#   fp8-bench   conversion from FP8 hub weights (Kimi-K2's and MiniMax-M2.7's shapes, cut) on this host's cores and disk
#   nemotron-h  on one GPU: Nemotron-H (Mamba-2) as HybridModel: verify --spec te at real width, and Megatron-LM training
#               steps (after install: mamba_ssm built without its CUDA extension)
#   hybrid-pp2  on two GPUs: a Megatron-LM HybridModel training save at PP 2 (with MTP), exported bit for bit
#   train-distopt  on one GPU: Megatron-LM training steps with --use-distributed-optimizer (Qwen2.5-0.5B's shape and
#               Qwen3-30B-A3B's first 2 layers), whose saves hold that optimizer's state beside the weights
#   verify-v2lite  DeepSeek-V2-Lite whole, with megatron-core 0.18.0 (carry .whl018: 0.19 cannot build it)
#   te-export   megatron-core's own TE-spec grouped-GEMM saves exported bit-exactly (scripts/gpu/gpu_te_export.py)
#   bench       weight sync (gather_hf_weights) at TP=2 and EP=2, and loading, on the GPUs
#   scaling     both directions (or those in $DIRECTIONS) over 1 to 8 workers and ranks (or $COUNTS; $MODES:
#               workers or ranks alone) against cp -r, on the models in $MODELS (default the MoE and 7B cuts;
#               sources removed unless KEEP_SOURCES=true), and the peers' approach on the models in $PEERS
#               (default qwen2.5-0.5b; empty: none), on the host's cores and disk; $SHARD: mcore-to-hf's
#               --max-shard-size; then the per-byte costs between two sizes of one model (slopes.md,
#               scripts/bench/cut_slopes.py)
#   scaling-large  mcore-to-hf alone on the MoE shape cut to as many layers (3 or 4) as two copies of it leave
#               the disk a tenth free (bench_scaling.py --disk-for-two), over the counts in $COUNTS (default 1 4 8)
#   profile     what bounds a conversion on this host: py-spy (carry .pyspy) of the MoE shape, both directions
#               (or those in $DIRECTIONS) at the worker counts in $PROFILE_WORKERS (default 1)
#   one-worker  one worker both ways (or $DIRECTIONS), MoE shape (or $MODEL), for each source tree in $TREES
#               (default: this one; e.g. an earlier commit's `git archive` unpacked into old/, carried as an
#               untracked folder), $ROUNDS rounds (default 2) alternating the trees: the import of each
#               direction's modules, seconds, CPU seconds, peak memory split anonymous / file-backed
#               (scripts/bench/memory_split.py), and the bytes mcore-to-hf copies file to file against those it
#               reads into memory
#   trees       the same at $WORKERS workers (default 8), without the bytes
set -uo pipefail
cd "$(dirname "$0")/../.."

# The machine's rule: no NVLink multicast (also in programs that set their own environment).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Megatron-LM's rule for TP > 1 before Blackwell; fp32 comparisons under TE need TF32 off.
export CUDA_DEVICE_MAX_CONNECTIONS=1 NVIDIA_TF32_OVERRIDE=0
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONWARNINGS=ignore
STATE=/tmp/mconvert-session
WORK=/tmp/mconvert-work

case "${1:-}" in
prepare | chunk)
  exec bash scripts/gpu/gpu_te_setup.sh "$@"
  ;;
peer-wheels)
  # The peers' wheel folders carried with this call (build/peers/wheels/...), kept for the peers stage.
  mkdir -p /tmp/peerwheels && cp -r build/peers/wheels/* /tmp/peerwheels/ && du -sh /tmp/peerwheels/*
  exit
  ;;
run)
  budget=${2:?seconds}
  shift 2
  ;;
*)
  echo "usage: $0 prepare | chunk N | run SECONDS STAGE..." >&2
  exit 2
  ;;
esac

: "${OUT:?OUT must name the folder for the results}"
mkdir -p "$OUT" "$STATE" "$WORK"
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
stage_done() { [ -e "$STATE/$1" ]; }
mark() { touch "$STATE/$1"; }
note() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - start))s] $*" | tee -a "$OUT/session.log"; }
# One GPU, one family: `mconvert verify --spec te` of VERIFY_JOB at its real width, then Megatron-LM training steps
# of TRAIN_JOB (small enough for fp32 with its optimizer's save), into $OUT/STAGE.log.
# Gated delta-net (the qwen-gdn stages) imports flash-linear-attention: its wheels are carried in .whl.
QWEN3_NEXT='qwen3-next-80b-a3b-instruct@4+num_experts=64'
QWEN3_5='qwen3.5-0.8b@4'
QWEN3_5_MOE='qwen3.5-35b-a3b@4+text_config.num_experts=64'
DEEPSEEK_V32='deepseek-v3.2@2+first_k_dense_replace=1+n_routed_experts=16'
GLM_51='glm-5.1@2+first_k_dense_replace=1+n_routed_experts=16'
# Test-sized models for the FSDP saves (fixtures): dense with GQA, MoE, and multi-latent attention with MoE and a
# multi-token prediction layer; vocabulary 256.
TINY='+hidden_size=64+num_attention_heads=4+num_key_value_heads=2+intermediate_size=128+vocab_size=256'
LLAMA_TINY="llama-3.1-8b@2$TINY"
QWEN3_TINY="qwen3-8b@2$TINY+head_dim=16"
QWEN3_MOE_TINY="qwen3-30b-a3b@2$TINY+head_dim=16+num_experts=8+num_experts_per_tok=2+moe_intermediate_size=32"
DEEPSEEK_TINY="deepseek-v3@2$TINY+num_key_value_heads=4+q_lora_rank=48+kv_lora_rank=32+qk_nope_head_dim=32+qk_rope_head_dim=16"
DEEPSEEK_TINY+="+v_head_dim=32+n_routed_experts=8+n_group=4+topk_group=2+num_experts_per_tok=4+moe_intermediate_size=32"
DEEPSEEK_TINY+="+first_k_dense_replace=1"
# Megatron-FSDP at EP 2 (DeepSeek-V3's architecture with MTP, bf16, random init), its save kept: a fixture.
MEGATRON_FSDP_EP2="--fsdp megatron --dtype bf16 --from-scratch --mtp --steps 0 --keep-saves $WORK/fsdp-dp2-saves|$DEEPSEEK_TINY:ep2"
# gpu_train.py's flags that run a conversion written for TP, EP or ETP above 1 at 1 (torch_dist and fsdp_dtensor
# reshard), on one GPU.
AT_ONE=(--megatron-flag=--tensor-model-parallel-size=1 --megatron-flag=--expert-model-parallel-size=1
        --megatron-flag=--expert-tensor-parallel-size=1)
# Each of "$@" is "OPTIONS|JOBS": gpu_train.py on two GPUs with them (FSDP wants CUDA_DEVICE_MAX_CONNECTIONS unset), the
# saves kept in $WORK/fsdp-dp2-saves archived after each, so that a call cut short returns what it made.
two_gpu_fsdp_runs() {
  local stage=$1 code=0 last run
  shift
  for run in "$@"; do
    env -u CUDA_DEVICE_MAX_CONNECTIONS python3 scripts/gpu/gpu_train.py --nproc 2 ${run%%|*} --work "$WORK/train" \
      --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" ${run#*|} >> "$OUT/$stage.log" 2>&1
    last=$?
    note "$stage ${run%%|*}: exit $last"
    [ "$last" = 3 ] && code=3
    [ -d "$WORK/fsdp-dp2-saves" ] && tar -czf "$OUT/fsdp-dp2-saves.tar.gz" -C "$WORK" fsdp-dp2-saves
  done
  [ "$code" = 3 ] || mark "$stage"
}
install_fla() {
  # fla as the install stage left it in /tmp/site-kernels, its kernels with one autotune config each
  # (scripts/gpu/fla_one_config/sitecustomize.py): no compiling and timing of every config on a machine that keeps no
  # Triton cache.
  export PYTHONPATH=$PWD/scripts/gpu/fla_one_config:/tmp/site-kernels:$PYTHONPATH
  python3 -c "import fla; print('flash-linear-attention', fla.__version__)" >> "$OUT/session.log" 2>&1
}
verify_and_train() {
  local stage=$1 verify_job=$2 train_job=$3 code
  python3 scripts/gpu/gpu_verify.py --spec te --work "$WORK/verify" --out "$OUT/verify" --deadline-s "$(($(left) / 2))" \
    "$verify_job" > "$OUT/$stage.log" 2>&1
  note "$stage verify: exit $?"
  python3 scripts/gpu/gpu_train.py --nproc 1 --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" \
    "$train_job" >> "$OUT/$stage.log" 2>&1
  code=$?
  note "$stage train: exit $code"
  [ "$code" = 3 ] || mark "$stage"
}

{
  nvidia-smi -L
  python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} >> "$OUT/session.log" 2>&1

for stage in "$@"; do
  if stage_done "$stage"; then note "$stage: done in an earlier call"; continue; fi
  if [ "$(left)" -lt 45 ]; then note "$stage: skipped, deadline"; continue; fi
  note "$stage: start ($(left) s left)"
  case "$stage" in
  install)
    if python3 -c "import megatron.training, transformer_engine.pytorch" 2>/dev/null; then
      mark install
    else
      t0=$(date +%s)
      MAX_JOBS=$(nproc) timeout "$(left)" bash scripts/gpu/gpu_te_setup.sh install > "$OUT/install.log" 2>&1
      code=$?
      note "install: exit $code in $(($(date +%s) - t0)) s"
      python3 -c "import megatron.training" 2>/dev/null && mark install
    fi
    python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" >> "$OUT/session.log" 2>&1
    python3 -c "import transformer_engine as te; print('transformer_engine', te.__version__)" >> "$OUT/session.log" 2>&1 \
      || echo "transformer_engine: not importable (local spec only)" >> "$OUT/session.log"
    ;;
  mcore)
    # megatron-core alone (carry .whl), for the stages that build its models with the local spec (bench).
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/megatron_core-*.whl
    python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" >> "$OUT/session.log" 2>&1 && mark mcore
    ;;
  launch)
    python3 scripts/gpu/gpu_train.py --launcher train.sh --work "$WORK/launch" --out "$OUT" --deadline-s "$(left)" \
      --done-dir "$STATE" qwen2.5-0.5b:tp2 > "$OUT/launch.log" 2>&1
    code=$?
    note "launch: exit $code"
    [ "$code" = 3 ] || mark launch
    ;;
  verify-mla)
    # Sigmoid-routed MoE at real widths under TE: GLM-4.5-Air's first dense and first MoE layer (partial rope,
    # q/k/v biases) at TP2xEP2xETP1 and with the two layers on two stages; DeepSeek-V3's (multi-latent
    # attention; its first three layers are dense, hence the field). DeepSeek-V2-Lite: verify-v2lite.
    python3 scripts/gpu/gpu_verify.py --spec te --work "$WORK/verify" --out "$OUT/verify" --deadline-s "$(($(left) - 60))" \
      glm-4.5-air@2:tp2ep2etp1 glm-4.5-air@2:pp2 'deepseek-v3@2+first_k_dense_replace=1:ep2' > "$OUT/verify-mla.log" 2>&1
    note "verify-mla: exit $?"
    mark verify-mla
    ;;
  train-mla | verify-mla-bf16)
    # One GPU: DeepSeek-V3's and GLM-4.5-Air's first dense and first MoE layer, hidden 2048 and 32 experts (all
    # else as published: MLA ranks, heads, group-limited sigmoid routing with the expert bias, partial rope), small
    # enough for fp32 training with its optimizer save on one GPU and its disk. train-mla: Megatron-LM training
    # steps (scripts/gpu/gpu_train.py); verify-mla-bf16: mconvert verify --spec te in bf16, where the routers' dtype
    # (--moe-router-dtype fp32) shows.
    models=("deepseek-v3@2+first_k_dense_replace=1+hidden_size=2048+n_routed_experts=32" "glm-4.5-air@2+hidden_size=2048+n_routed_experts=32")
    if [ "$stage" = train-mla ]; then
      # ${MTP:+--mtp}: with the multi-token prediction layer each config names, as the hub's checkpoints hold it.
      python3 scripts/gpu/gpu_train.py --nproc 1 ${MTP:+--mtp} --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" \
        --done-dir "$STATE" "${models[0]}:tp1" "${models[1]}:tp1" > "$OUT/train-mla.log" 2>&1
    else
      python3 scripts/gpu/gpu_verify.py --spec te --work "$WORK/verify" --out "$OUT/verify" --deadline-s "$(($(left) - 60))" \
        "${models[0]}:tp1:bf16" "${models[1]}:tp1:bf16" > "$OUT/verify-mla-bf16.log" 2>&1
    fi
    code=$?
    note "$stage: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  kimi)
    # Kimi-K2 as released (kimi_k2 with its own code, read as DeepseekV3ForCausalLM; YaRN beta_fast 1, which
    # Megatron-LM's flags cannot set), its first dense and first MoE layer with 32 of its 384 experts; trained at
    # hidden 2048 with the setting megatron_args.sh states (gpu_train.py passes it as the driver's --config-field).
    verify_and_train kimi 'kimi-k2-instruct@2+n_routed_experts=32:tp1' 'kimi-k2-instruct@2+n_routed_experts=32+hidden_size=2048:tp1'
    ;;
  gpt-oss)
    # gpt-oss-20b's first two layers (sliding, then full attention); trained with 8 of its 32 experts.
    verify_and_train gpt-oss 'gpt-oss-20b@2:tp1' 'gpt-oss-20b@2+num_local_experts=8:tp1'
    ;;
  gpt-oss-mxfp4)
    # gpt-oss-20b's first two layers stored as the hub stores them (MXFP4 experts, quantization_config kept): converted
    # and verified under TE at TP 1 from a TP 2 x EP 2 save, transformers dequantizing the same blocks.
    python3 scripts/gpu/gpu_verify.py --spec te --quantized --work "$WORK/verify" --out "$OUT/verify" --deadline-s "$(left)" \
      'gpt-oss-20b@2:tp2ep2etp1>tp1' > "$OUT/gpt-oss-mxfp4.log" 2>&1
    note "gpt-oss-mxfp4: exit $?"
    mark "$stage"
    ;;
  gdn-kernels)
    # Qwen3-Next's fp32 verify under TE four times, each side on fla's Triton kernels or its own PyTorch delta rule
    # (scripts/gpu/gdn_kernels.py).
    install_fla
    python3 scripts/gpu/gdn_kernels.py --work "$WORK/gdn-kernels" --out "$OUT" "$QWEN3_NEXT:tp1" > "$OUT/gdn-kernels.log" 2>&1
    note "gdn-kernels: exit $?"
    mark "$stage"
    ;;
  minimax)
    # partial_rotary_factor beside the released rotary_dim: this machine's transformers (5.17) reads only the former
    # (5.24 reads rotary_dim too), and would run the HF side with rope on every dim of a head.
    verify_and_train minimax 'minimax-m2.7@2+num_local_experts=32+partial_rotary_factor=0.5:tp2ep2>tp1' \
      'minimax-m2.7@2+num_local_experts=16+hidden_size=2048+partial_rotary_factor=0.5:tp1'
    ;;
  qwen-gdn-verify)
    # Qwen3-Next, Qwen3.5 (image-text, dense) and Qwen3.5-MoE, cut to one full-attention period (3 gated delta-net
    # layers, then full attention) at real width, with 64 of their experts: verified under Transformer Engine at TP 1
    # from checkpoints written at TP 2 x EP 2 or PP 2 (torch_dist reshards on loading) and as written.
    install_fla
    # No job starts in the last ${GDN_TRAIN_S:-0} s: the training stage's, when it follows in the same call.
    python3 scripts/gpu/gpu_verify.py --spec te --work "$WORK/verify" --out "$OUT/verify" --deadline-s "$(($(left) - ${GDN_TRAIN_S:-0}))" \
      ${GDN_JOBS:-"$QWEN3_5:tp2pp2>tp1" "$QWEN3_NEXT:tp2ep2>tp1" "$QWEN3_5_MOE:tp2ep2>tp1" "$QWEN3_NEXT:pp2>tp1"} \
      > "$OUT/qwen-gdn-verify.log" 2>&1
    note "qwen-gdn-verify: exit $?"
    mark "$stage"
    ;;
  qwen-gdn-train)
    # The same families' Megatron-LM training steps, with 16 experts. flash-linear-attention refuses the gated
    # delta rule's backward on Hopper with Triton 3.4 to 3.7.0 (wrong gradients there): --deterministic-mode has
    # megatron-core run its PyTorch delta rule instead.
    install_fla
    python3 scripts/gpu/gpu_train.py --nproc 1 --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" \
      --megatron-flag=--deterministic-mode "$QWEN3_5:tp1" "${QWEN3_NEXT/=64/=16}:tp1" "${QWEN3_5_MOE/=64/=16}:tp1" \
      > "$OUT/qwen-gdn-train.log" 2>&1
    code=$?
    note "qwen-gdn-train: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  dsa-verify)
    # DeepSeek-V3.2 and GLM-5.1 (sparse attention) cut to their first dense and first MoE layer at real width with 16
    # of their experts, verified under Transformer Engine at TP 1 as written and from TP 2 x EP 2 and TP 2 x PP 2
    # saves; verify adds a prompt longer than the indexer's top-k (2048), so that it chooses.
    python3 scripts/gpu/gpu_verify.py --spec te --work "$WORK/verify" --out "$OUT/verify" --deadline-s "$(($(left) - ${DSA_TRAIN_S:-0}))" \
      ${DSA_JOBS:-"$DEEPSEEK_V32:tp2ep2>tp1" "$DEEPSEEK_V32:tp1" "$GLM_51:tp2pp2>tp1"} > "$OUT/dsa-verify.log" 2>&1
    note "dsa-verify: exit $?"
    mark "$stage"
    ;;
  dsa-train)
    # Their Megatron-LM training steps at hidden 2048 with 32 experts and a top-k of 64 (the training sequences are 256
    # tokens: the indexer chooses).
    python3 scripts/gpu/gpu_train.py --nproc 1 --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" \
      "${DEEPSEEK_V32/=16/=32}+hidden_size=2048+index_topk=64:tp1" "${GLM_51/=16/=32}+hidden_size=2048+index_topk=64:tp1" \
      > "$OUT/dsa-train.log" 2>&1
    code=$?
    note "dsa-train: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  fsdp)
    # Megatron-LM's two FSDP wrappers on test-sized models (dense, tied, MoE, MLA with MTP), some converted at
    # another TP or EP than the run's: Megatron-FSDP from a torch_dist checkpoint (its load stops: KeyError 'model')
    # and from random init in bf16 (its fp32 load of a SwiGLU model fails in Megatron-LM's own code), FSDP2 from
    # torch_dist checkpoints saving torch_dist, and from random init saving torch_dcp; the runs' first step dumps
    # their weights, to hold the saves against. HF configs, tokens, loss logs and --lr 0 saves come back in
    # fsdp-saves-{megatron,torch}.tar.gz (tests/fixtures/fsdp). FSDP wants CUDA_DEVICE_MAX_CONNECTIONS unset.
    runs=("--fsdp megatron|$LLAMA_TINY:tp2"
          "--fsdp megatron --dtype bf16 --from-scratch --mtp|$DEEPSEEK_TINY:tp1"
          "--fsdp torch|$LLAMA_TINY:tp2 $QWEN3_MOE_TINY:ep2"
          "--fsdp torch --ckpt-format torch_dcp --from-scratch|$LLAMA_TINY:tp1"
          "--fsdp torch --ckpt-format torch_dcp --from-scratch --mtp|$DEEPSEEK_TINY:tp1")
    code=0
    for run in "${runs[@]}"; do
      wrapper=${run#--fsdp }; wrapper=${wrapper%% *}  # megatron or torch: one archive each (16 MiB a file comes back)
      env -u CUDA_DEVICE_MAX_CONNECTIONS python3 scripts/gpu/gpu_train.py --nproc 1 ${run%%|*} "${AT_ONE[@]}" \
        --keep-saves "$WORK/fsdp-saves-$wrapper" --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" \
        ${run#*|} >> "$OUT/$stage.log" 2>&1
      last=$?
      note "$stage ${run%%|*}: exit $last"
      [ "$last" = 3 ] && code=3
    done
    for wrapper in megatron torch; do
      [ -d "$WORK/fsdp-saves-$wrapper" ] && tar -czf "$OUT/fsdp-saves-$wrapper.tar.gz" -C "$WORK" "fsdp-saves-$wrapper" \
        && ls -l "$OUT/fsdp-saves-$wrapper.tar.gz" >> "$OUT/session.log"
    done
    [ "$code" = 3 ] || mark "$stage"
    ;;
  fsdp-in)
    # On one GPU: Megatron-FSDP (bf16) trained from hf-to-mcore --format fsdp_dtensor: Llama converted for TP 2,
    # Qwen3-MoE for EP 2, DeepSeek-V3 with MTP for TP 2 x EP 2, each run at TP 1, EP 1 (its --lr 0 save exported, its
    # step losses, its --lr 1e-4 losses). Beside them, DDP in bf16 from the torch_dist conversions of the same Llama and
    # Qwen3-MoE, whose losses Megatron-FSDP's must give from its first step on; an injected fault, the Llama conversion
    # with its Adam step counts taken out (Megatron-FSDP's loading step leaves them at 1: its first update is then
    # smaller); the Llama in fp32, where Megatron-LM's own load stops (its SwiGLU split: AttributeError); and Qwen2.5's
    # tied embeddings.
    runs=("--fsdp megatron --dtype bf16 --format fsdp_dtensor|$LLAMA_TINY:tp2"
          "--dtype bf16|$LLAMA_TINY:tp2"
          "--fsdp megatron --dtype bf16 --format fsdp_dtensor --without-keys \\.step\$|$LLAMA_TINY:tp2"
          "--fsdp megatron --dtype bf16 --format fsdp_dtensor|$QWEN3_MOE_TINY:ep2"
          "--fsdp megatron --dtype bf16 --format fsdp_dtensor --mtp|$DEEPSEEK_TINY:tp2ep2"
          "--dtype bf16|$QWEN3_MOE_TINY:ep2"
          "--fsdp megatron --format fsdp_dtensor --steps 0|$LLAMA_TINY:tp1"
          "--fsdp megatron --dtype bf16 --format fsdp_dtensor|qwen2.5-0.5b@2$TINY:tp1")
    code=0
    for run in "${runs[@]}"; do
      env -u CUDA_DEVICE_MAX_CONNECTIONS python3 scripts/gpu/gpu_train.py --nproc 1 ${run%%|*} "${AT_ONE[@]}" \
        --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" ${run#*|} >> "$OUT/$stage.log" 2>&1
      last=$?
      note "$stage ${run%%|*}: exit $last"
      [ "$last" = 3 ] && code=3
    done
    [ "$code" = 3 ] || mark "$stage"
    ;;
  fsdp2-dcp-in)
    # On one GPU: FSDP2 saving its own torch_dcp (--ckpt-format torch_dcp) from torch_dist conversions, told to detect
    # the format it loads (--auto-detect-ckpt-format; fp32; Llama, Qwen3-MoE converted for EP 2). Measured: its load
    # stops (KeyError: 'model'), as without the flag.
    env -u CUDA_DEVICE_MAX_CONNECTIONS python3 scripts/gpu/gpu_train.py --nproc 1 --fsdp torch --ckpt-format torch_dcp \
      --megatron-flag=--auto-detect-ckpt-format "${AT_ONE[@]}" --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" \
      --done-dir "$STATE" "$LLAMA_TINY:tp1" "$QWEN3_MOE_TINY:ep2" >> "$OUT/$stage.log" 2>&1
    code=$?
    note "$stage: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  fsdp-in-launch)
    # On one GPU: the train.sh an fsdp_dtensor conversion writes, run as a user runs it (no FSDP flag beside it: its
    # LOAD_ARGS make the run Megatron-FSDP's), dense and MoE.
    env -u CUDA_DEVICE_MAX_CONNECTIONS python3 scripts/gpu/gpu_train.py --nproc 1 --launcher train.sh --dtype bf16 \
      --format fsdp_dtensor --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" \
      "$LLAMA_TINY:tp1" "$QWEN3_MOE_TINY:tp1" >> "$OUT/$stage.log" 2>&1
    code=$?
    note "$stage: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  fsdp-dp2)
    # On two GPUs (nvidia-h100-x2): Megatron-LM's FSDP saves at data-parallel size 2, each weight sharded over the two
    # ranks, of the jobs whose one-GPU saves are fixtures (Megatron-FSDP bf16 and FSDP2 torch_dcp, DeepSeek-V3's
    # architecture with MTP, from random init): Megatron's init does not depend on the data-parallel size, so the
    # one-GPU run's dumped weights hold these saves too. Kept for tests/fixtures/fsdp (scripts/gpu/save_fixture.py),
    # one archive after each job; no --lr run (--steps 0).
    keep=(--keep-saves "$WORK/fsdp-dp2-saves" --steps 0)
    runs=("--fsdp megatron --dtype bf16 --from-scratch --mtp ${keep[*]}|$DEEPSEEK_TINY:tp1"
          "--fsdp torch --ckpt-format torch_dcp --from-scratch --mtp ${keep[*]}|$DEEPSEEK_TINY:tp1"
          "--fsdp torch ${AT_ONE[*]}|$LLAMA_TINY:tp2")
    two_gpu_fsdp_runs "$stage" "${runs[@]}"
    ;;
  fsdp-dp2-train)
    # On two GPUs: what fsdp-dp2 left. FSDP2 at data-parallel size 2 from the Llama conversion at TP 2 with its lr 1e-4
    # run (the loss falls); Megatron-FSDP at EP 2 (DeepSeek-V3's architecture with MTP, bf16, random init: the dense
    # weights sharded over the two data-parallel ranks, each rank's experts its own), its save checked by transformers'
    # loss on the export and kept (fsdp-dp2-saves.tar.gz).
    two_gpu_fsdp_runs "$stage" "--fsdp torch ${AT_ONE[*]}|$LLAMA_TINY:tp2" "$MEGATRON_FSDP_EP2"
    ;;
  fsdp-ep2)
    # On two GPUs: fsdp-dp2-train's Megatron-FSDP save at EP 2 alone, each expert-parallel rank dumping its own experts
    # (tests/fixtures/fsdp/fsdp_dtensor-deepseek-ep2 and its experts.sha256.json: MADE.md there).
    two_gpu_fsdp_runs "$stage" "$MEGATRON_FSDP_EP2"
    ;;
  fp8-bench)
    # Conversion time and memory from FP8 hub weights on this host (scripts/bench/bench_convert.py, docs/performance.md):
    # Kimi-K2 as released cut to its first dense and first MoE layer (384 experts of 7168 x 2048: about 22 GB of
    # source, 40 GB written), then MiniMax-M2.7's first two layers; each source removed after its model.
    for model in ${FP8_MODELS:-kimi-k2-instruct@2 minimax-m2.7@2}; do
      [ "$(left)" -lt 120 ] && { note "fp8-bench $model: skipped, deadline"; continue; }
      timeout "$(left)" python3 scripts/bench/bench_convert.py --models "$model" --quantized --ep 8 --work-dir "$WORK/fp8" \
        --conditions warm --repeats 2 >> "$OUT/$stage.log" 2>&1
      note "fp8-bench $model: exit $?"
      rm -rf "$WORK/fp8"
    done
    nproc >> "$OUT/$stage.log"; free -g >> "$OUT/$stage.log"; df -h "$WORK" >> "$OUT/$stage.log"
    mark "$stage"
    ;;
  start)
    # The start of a small model's conversion on this host (scripts/bench/bench_start.py, docs/performance.md): a bf16
    # Qwen2.5-0.5B whole, hf-to-mcore until exit against cp -r, in rounds beside the checkout carried in build/old (the
    # tree before, when its conversion imported torch).
    python3 -c "import numpy, ml_dtypes, torch; print('numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'torch', torch.__version__)" \
      >> "$OUT/$stage.log" 2>&1
    timeout "$(left)" python3 scripts/bench/bench_start.py --work "$WORK/start" --rounds "${ROUNDS:-5}" \
      ${OLD_TREE:+--tree old=$OLD_TREE} --out "$OUT/start.jsonl" >> "$OUT/$stage.log" 2>&1
    note "start: exit $?"
    nproc >> "$OUT/$stage.log"
    mark "$stage"
    ;;
  nemotron-h)
    # Nemotron-H (Mamba-2 layers beside attention and MoE) as HybridModel on one GPU: mamba_ssm from a wheel built without
    # its CUDA extension (the install stage's, in /tmp/site-kernels; scripts/gpu/mamba_stand_in stands in for the extension, which
    # megatron-core's Mamba-2 layers never call). Without causal_conv1d (a CUDA build) megatron-core's fused training
    # path cannot run: the runs take its other path (--disable-mamba-mem-eff-path, the same function). Nemotron 3 Nano's
    # first 6 layers (M E M E M *) at real width with 16 of its 128 experts: verify --spec te at TP 1 from a TP 2 x EP 2
    # save and as written; then Megatron-LM training steps.
    export PYTHONPATH=$PWD/scripts/gpu/mamba_stand_in:/tmp/site-kernels:$PYTHONPATH
    python3 -c "import mamba_ssm; print('mamba_ssm', mamba_ssm.__version__)" >> "$OUT/session.log" 2>&1
    NEMOTRON_H=${NEMOTRON_H:-'nemotron-3-nano-30b-a3b@6+n_routed_experts=16'}
    python3 scripts/gpu/gpu_verify.py --spec te --model-class hybrid --work "$WORK/verify" --out "$OUT/verify" \
      --deadline-s "$(($(left) / 2))" "$NEMOTRON_H:tp2ep2>tp1" "$NEMOTRON_H:tp1" > "$OUT/$stage.log" 2>&1
    note "$stage verify: exit $?"
    python3 scripts/gpu/gpu_train.py --nproc 1 --model-class hybrid --megatron-flag=--disable-mamba-mem-eff-path \
      --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" "$NEMOTRON_H+hidden_size=1024:tp1" \
      >> "$OUT/$stage.log" 2>&1
    code=$?
    note "$stage train: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  hybrid-pp2)
    # On two GPUs: a Megatron-LM HybridModel training save made at PP 2 (MLA with a dense first layer, MoE and MTP: the
    # pattern's stages and its MTP part) from mconvert's hybrid checkpoint written so; the check exports the --lr 0
    # save and holds it to the HF input bit for bit.
    python3 scripts/gpu/gpu_train.py --nproc 2 --model-class hybrid --mtp --steps 0 --keep-saves "$WORK/hybrid-saves" \
      --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" --done-dir "$STATE" "$DEEPSEEK_TINY:pp2" >> "$OUT/$stage.log" 2>&1
    code=$?
    note "$stage: exit $code"
    [ -d "$WORK/hybrid-saves" ] && tar -czf "$OUT/hybrid-saves.tar.gz" -C "$WORK" hybrid-saves
    [ "$code" = 3 ] || mark "$stage"
    ;;
  hybrid)
    # HybridModel as Megatron-LM's pretrain_hybrid.py builds it (hybrid_config_from_args, HybridModelBuilder, the
    # Transformer Engine hybrid_stack_spec of --spec) on one GPU: mconvert's hybrid checkpoints written at TP 2 or EP 2
    # and run at TP 1 (torch_dist reshards): dense with q/k norms, MLA with a dense first layer, MoE and MTP, gated
    # delta-net beside gated attention, sparse attention, the MTP layers GPTModel cannot build beside those; then GPT
    # checkpoints that Megatron-LM's own load makes HybridModels of (HYBRID_ARGS). Each: step-1 loss against transformers, the loss falling, and the --lr 0 save (a
    # HybridModel training save) exported bit for bit.
    install_fla
    runs=("--model-class hybrid|$QWEN3_TINY:tp2 $DEEPSEEK_TINY:ep2"
          "--model-class hybrid --mtp|$DEEPSEEK_TINY:tp2 ${DEEPSEEK_V32}+hidden_size=2048:tp2"
          "--model-class hybrid --megatron-flag=--deterministic-mode|${QWEN3_5}:tp2"
          "--hybrid-args|$QWEN3_TINY:tp2 $QWEN3_MOE_TINY:ep2"
          "--model-class hybrid --mtp --megatron-flag=--deterministic-mode|${QWEN3_NEXT/=64/=16}:ep2")
    code=0
    # HYBRID_RUNS: the indices of the runs to do, in that order (default: all).
    for i in ${HYBRID_RUNS:-${!runs[@]}}; do
      run=${runs[$i]}
      python3 scripts/gpu/gpu_train.py --nproc 1 ${run%%|*} "${AT_ONE[@]}" --work "$WORK/train" --out "$OUT" \
        --deadline-s "$(left)" --done-dir "$STATE" ${run#*|} >> "$OUT/$stage.log" 2>&1
      last=$?
      note "$stage ${run%%|*}: exit $last"
      [ "$last" = 3 ] && code=3
    done
    [ "$code" = 3 ] || mark "$stage"
    ;;
  hybrid-verify)
    install_fla
    python3 scripts/gpu/gpu_verify.py --spec te --model-class hybrid --work "$WORK/verify" --out "$OUT/verify" \
      --deadline-s "$(($(left) - 30))" ${HYBRID_VERIFY_JOBS:-'deepseek-v3@2+first_k_dense_replace=1+n_routed_experts=32:ep2>tp1' \
      "$QWEN3_NEXT:tp2ep2>tp1" "$DEEPSEEK_V32:tp2ep2>tp1" 'gpt-oss-20b@2:ep2>tp1'} > "$OUT/hybrid-verify.log" 2>&1
    note "hybrid-verify: exit $?"
    mark "$stage"
    ;;
  peers)
    # The peers beside mconvert (scripts/gpu/gpu_peers.py), installed from the wheels of peers_setup.sh prepare: carried
    # in an earlier call (peer-wheels) and with this one.
    [ -d build/peers/wheels ] && mkdir -p /tmp/peerwheels && cp -r build/peers/wheels/* /tmp/peerwheels/
    PEER_WHEELS=/tmp/peerwheels bash scripts/gpu/peers_setup.sh install > "$OUT/peers.log" 2>&1
    code=$?
    note "peers install: exit $code"
    [ "$code" = 0 ] && touch "$STATE/peers-installed"
    python3 scripts/gpu/gpu_peers.py --work "$WORK/peers" --out "$OUT" --deadline-s "$(($(left) - 90))" \
      ${PEER_MODELS:-qwen2.5-0.5b qwen3-30b-a3b@2 'deepseek-v3@2+first_k_dense_replace=1+n_routed_experts=32' \
      'glm-4.5-air@2+n_routed_experts=32'} >> "$OUT/peers.log" 2>&1
    note "peers: exit $?"
    mark "$stage"
    ;;
  peers-new)
    # What the peers stage left (docs/peers.md): ms-swift on the DeepSeek-V3 cut, then the families mconvert added since,
    # each with the peers that have a converter for it ('MODEL#PEERS'; Megatron-Bridge 0.6.2 has none for DeepSeek-V3.2),
    # most valuable first, at real width with 2-6 layers and 16-32 experts. The peers' wheels: peers_setup.sh prepare,
    # carried partly by an earlier call (peer-wheels) and partly by this one; installed once a machine (the peers stage's
    # install, skipped when done). Gated delta-net needs flash-linear-attention, Nemotron-H mamba_ssm (built without its
    # CUDA extension, scripts/gpu/mamba_stand_in for it): their wheels from build/peers/wheels/kernels or .whl. Each step is
    # killed at PEER_STEP_S (default 240 s) or at the deadline; a model whose steps all ran is marked in
    # $STATE/peers-new-done, so that the stage called again goes on with the models left (gpu_peers.py's exit 3).
    [ -d build/peers/wheels ] && mkdir -p /tmp/peerwheels && cp -r build/peers/wheels/* /tmp/peerwheels/
    if [ ! -e "$STATE/peers-installed" ]; then
      PEER_WHEELS=/tmp/peerwheels bash scripts/gpu/peers_setup.sh install > "$OUT/peers-new.log" 2>&1
      code=$?
      note "peers install: exit $code"
      [ "$code" = 0 ] && touch "$STATE/peers-installed"
    fi
    if ! python3 -c "import fla, mamba_ssm" 2>/dev/null; then
      kernel_wheels=()
      for name in fla_core flash_linear_attention einops mamba_ssm; do
        wheel=$(ls /tmp/peerwheels/kernels/"$name"-*.whl .whl/"$name"-*.whl 2>/dev/null | head -1)
        if [ -n "$wheel" ]; then kernel_wheels+=("$wheel"); else note "peers-new: no $name wheel (build/peers/wheels/kernels or .whl)"; fi
      done
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${kernel_wheels[@]}" >> "$OUT/peers-new.log" 2>&1
    fi
    export PYTHONPATH=$PWD/scripts/gpu/mamba_stand_in:$PYTHONPATH
    python3 -c "import fla, mamba_ssm; print('flash-linear-attention', fla.__version__, 'mamba_ssm', mamba_ssm.__version__)" >> "$OUT/session.log" 2>&1
    PEER_STEP_S=${PEER_STEP_S:-240}
    python3 scripts/gpu/gpu_peers.py --work "$WORK/peers" --out "$OUT/peers-new" --deadline-s "$(($(left) - 20))" \
      --step-timeout-s "$PEER_STEP_S" --done-dir "$STATE/peers-new-done" ${PEER_NEW_MODELS:-\
      'deepseek-v3@2+first_k_dense_replace=1+n_routed_experts=32#swift' 'gpt-oss-20b@2' "${QWEN3_NEXT/=64/=32}" \
      'nemotron-3-nano-30b-a3b@6+n_routed_experts=16' "${QWEN3_5_MOE/=64/=32}" "${DEEPSEEK_V32/=16/=32}#swift" "${GLM_51/=16/=32}" \
      'minimax-m2.7@2+num_local_experts=32+partial_rotary_factor=0.5' "$QWEN3_5"} >> "$OUT/peers-new.log" 2>&1
    code=$?
    note "peers-new: exit $code"
    [ "$code" = 3 ] || mark "$stage"
    ;;
  train-distopt)
    python3 scripts/gpu/gpu_train.py --nproc 1 --distributed-optimizer --work "$WORK/train" --out "$OUT" --deadline-s "$(left)" \
      --done-dir "$STATE" qwen2.5-0.5b:tp1 qwen3-30b-a3b@2:tp1 > "$OUT/train-distopt.log" 2>&1
    code=$?
    note "train-distopt: exit $code"
    [ "$code" = 3 ] || mark train-distopt
    ;;
  verify-v2lite)
    # Megatron-core 0.19 builds a query norm that V2-Lite does not have (docs/verification.md); 0.18 is the
    # newest that loads it. Its own folder, without Transformer Engine (local spec).
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site018 .whl018/*.whl
    PYTHONPATH=/tmp/site018 python3 -c "import megatron.core as m; print('verify-v2lite: megatron-core', m.__version__)" >> "$OUT/session.log" 2>&1
    PYTHONPATH=/tmp/site018:$PWD python3 scripts/gpu/gpu_verify.py --spec local --work "$WORK/verify" --out "$OUT/verify" \
      --deadline-s "$(($(left) - 60))" deepseek-v2-lite:ep2 > "$OUT/verify-v2lite.log" 2>&1
    note "verify-v2lite: exit $?"
    mark verify-v2lite
    ;;
  scaling)
    # Each model of $MODELS (default: the MoE shape, then the 7B shape) both directions over workers and torchrun
    # ranks (the MoE shape's source shared with one-worker and profile); the peers' row with the last model.
    set -- ${MODELS:-qwen3-235b-a22b@2 qwen2.5-7b-instruct@14}
    while [ $# -gt 0 ]; do
      model=$1; shift
      if [ $# -gt 0 ]; then peers="" deadline=$(($(left) * 2 / 3)); else peers=${PEERS-qwen2.5-0.5b} deadline=$(($(left) - 30)); fi
      timeout "$(left)" python3 scripts/bench/bench_scaling.py --work-dir "$WORK/scaling" --out "$OUT/scaling" --models "$model" \
        --directions ${DIRECTIONS:-hf-to-mcore mcore-to-hf} ${SHARD:+--max-shard-size $SHARD} ${COUNTS:+--counts $COUNTS} \
        ${MODES:+--modes $MODES} --peers $peers --keep-sources ${KEEP_SOURCES:-false} --deadline-s "$deadline" >> "$OUT/scaling.log" 2>&1
      note "scaling $model: exit $?"
    done
    python3 scripts/bench/cut_slopes.py "$OUT/scaling/results.jsonl" > "$OUT/slopes.md" 2>&1
    mark scaling
    ;;
  scaling-large)
    # Qwen3-235B-A22B's embedding and output layer take 2.49 GB, each of its layers 4.97 GB (bf16).
    mkdir -p "$WORK/large"
    free=$(df --output=avail -B1 "$WORK/large" | tail -1)
    layers=$(( (free * 9 / 20 - 2490000000) / 4970000000 ))
    layers=$(( layers > 4 ? 4 : layers ))
    note "scaling-large: $((free / 1000000000)) GB free: qwen3-235b-a22b@$layers"
    if [ "$layers" -ge 3 ]; then
      timeout "$(left)" python3 scripts/bench/bench_scaling.py --work-dir "$WORK/large" --out "$OUT/scaling" --models "qwen3-235b-a22b@$layers" \
        --directions mcore-to-hf --disk-for-two ${SHARD:+--max-shard-size $SHARD} --counts ${COUNTS:-1 4 8} --peers --keep-sources false \
        --deadline-s "$(($(left) - 60))" >> "$OUT/scaling.log" 2>&1
      note "scaling-large: exit $?"
    fi
    rm -rf "$WORK/large"
    mark scaling-large
    ;;
  profile)
    # The source where the scaling stage finds it; mcore-to-hf's input made by one plain hf-to-mcore when
    # only that direction is profiled.
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy .pyspy/*.whl
    model=${MODEL:-qwen3-235b-a22b@2} sources="$WORK/scaling" dir="$WORK/profile"
    (cd scripts/bench && python3 -c "from pathlib import Path; from bench_convert import make_source; make_source('$model', Path('$sources'))") > "$OUT/profile.log" 2>&1
    for direction in ${DIRECTIONS:-hf-to-mcore mcore-to-hf}; do
      if [ $direction = hf-to-mcore ]; then
        from="$sources/$model" to="$dir/mc"
      else
        from="$dir/mc" to="$dir/back"
        [ -e "$dir/mc" ] || python3 -m mconvert hf-to-mcore --load-dir "$sources/$model" --save-dir "$dir/mc" > /dev/null 2>&1
      fi
      for workers in ${PROFILE_WORKERS:-1}; do
        # The output of the run before removed first, not replaced by --overwrite (whose removal of it,
        # 1 s per 2.5 GB on the CPU box, is not the conversion's).
        rm -rf "$to"; sync; find "$from" -type f -exec cat {} + > /dev/null
        timeout "$(left)" /tmp/pyspy/bin/py-spy record --threads --idle --nonblocking -r 100 -f raw -o "$dir/$direction-$workers.raw" -- \
          python3 -m mconvert $direction --load-dir "$from" --save-dir "$to" --workers $workers --overwrite >> "$OUT/profile.log" 2>&1
        # The same without the profiler: seconds, CPU seconds, peak memory.
        rm -rf "$to"; sync; find "$from" -type f -exec cat {} + > /dev/null
        echo -n "$direction, workers $workers: " >> "$OUT/profile.log"
        timeout "$(left)" python3 scripts/bench/memory_split.py -- \
          python3 -m mconvert $direction --load-dir "$from" --save-dir "$to" --workers $workers --overwrite >> "$OUT/profile.log" 2>&1
      done
    done
    python3 scripts/bench/profile_summary.py --rate 100 "$dir"/*.raw > "$OUT/profile.txt" 2>&1
    note "profile: exit $?"
    rm -rf "$dir"
    mark profile
    ;;
  one-worker|trees)
    # The source where the scaling stage finds it (made once a session). `python3 -P`: the tree's mconvert, not
    # the working directory's (which `-m` would put first on the path).
    model=${MODEL:-qwen3-235b-a22b@2} sources="$WORK/scaling" dir="$WORK/$stage" log="$OUT/$stage.log"
    workers=1 && [ $stage = trees ] && workers=${WORKERS:-8}
    (cd scripts/bench && python3 -c "from pathlib import Path; from bench_convert import make_source; make_source('$model', Path('$sources'))") > "$log" 2>&1
    for tree in ${TREES:-.}; do
      for round in 1 2 3; do
        for modules in mcore_to_hf hf_to_mcore; do
          echo -n "tree $tree, import of $modules's modules: " >> "$log"
          PYTHONPATH=/tmp/site:$tree python3 -P -c "import time; t = time.time(); import mconvert.cli, mconvert.converters.$modules; print(round(time.time() - t, 2), 's')" >> "$log" 2>&1
        done
      done
    done
    for round in $(seq ${ROUNDS:-2}); do
      for tree in ${TREES:-.}; do
        for direction in ${DIRECTIONS:-hf-to-mcore mcore-to-hf}; do
          if [ $direction = hf-to-mcore ]; then from="$sources/$model" to="$dir/mc"; else from="$dir/mc" to="$dir/back"; fi
          [ -e "$from" ] || python3 -P -m mconvert hf-to-mcore --load-dir "$sources/$model" --save-dir "$from" --workers 8 > /dev/null 2>&1
          rm -rf "$to"; sync; find "$from" -type f -exec cat {} + > /dev/null
          echo -n "round $round, tree $tree, $direction, workers $workers: " >> "$log"
          PYTHONPATH=/tmp/site:$tree timeout "$(left)" python3 scripts/bench/memory_split.py -- \
            python3 -P -m mconvert $direction --load-dir "$from" --save-dir "$to" --workers $workers --overwrite >> "$log" 2>&1
        done
      done
    done
    [ $stage = trees ] && { rm -rf "$dir"; mark trees; note "trees: done"; continue; }
    python3 - "$dir/mc" >> "$log" 2>&1 <<'PY'
import collections, math, sys
from mconvert.converters.mcore_sources import open_megatron_checkpoint, piece_region, stored_key
from mconvert.converters.mcore_to_hf import file_copies, plan_export
source = open_megatron_checkpoint(sys.argv[1])
plan, _ = plan_export(source)
shapes = source.stored_shapes(plan)
counted = collections.Counter()
for piece in plan.pieces:
    key = stored_key(piece, shapes)
    way = "copied file to file" if file_copies(plan, piece, source, shapes) is not None else "through memory"
    counted[way] += math.prod(piece_region(piece, shapes[key])[1]) * source.dcp.dtypes[key].itemsize
print("mcore-to-hf bytes:", dict(counted))
PY
    note "one-worker: exit $?"
    rm -rf "$dir"
    mark one-worker
    ;;
  bench)
    {
      timeout "$(left)" python3 scripts/bench/bench_weight_sync.py --model qwen2.5-7b-instruct@8 --tp 2 --device cuda
      timeout "$(left)" python3 scripts/bench/bench_weight_sync.py --model qwen3-30b-a3b@4 --ep 2 --device cuda
      timeout "$(left)" python3 scripts/bench/bench_load.py --model qwen2.5-7b-instruct@8 --work-dir "$WORK/load" --tp 2 --device cuda
    } > "$OUT/bench.log" 2>&1
    note "bench: exit $?"
    mark bench
    ;;
  te-export)
    timeout "$(left)" python3 scripts/gpu/gpu_te_export.py --work "$WORK/te-export" --out "$OUT" > "$OUT/te_export.log" 2>&1
    note "te-export: exit $?"
    mark te-export
    ;;
  *)
    note "unknown stage $stage"
    ;;
  esac
done
note "end"

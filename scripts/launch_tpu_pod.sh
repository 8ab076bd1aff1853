#!/usr/bin/env bash
# Run train.py on every worker of a Cloud TPU VM slice (one JAX process per worker).
#
#   scripts/launch_tpu_pod.sh --name mamba-v5p --zone us-east5-a --accelerator v5p-32 \
#       --bucket gs://my-bucket --run 130m-v5p32 -- --config configs/130m.py
#
#   scripts/launch_tpu_pod.sh --dry-run ... -- ...    # print the gcloud commands, run nothing
#   scripts/launch_tpu_pod.sh --name mamba-v5p --zone us-east5-a --logs   # re-attach to the logs
#   scripts/launch_tpu_pod.sh --name mamba-v5p --zone us-east5-a --stop   # save and stop
#
# What it does:
#   1. reuses the TPU VM slice --name, or creates it (--accelerator, --version, --spot);
#   2. copies the project's committed tree (git archive HEAD) to every worker and
#      installs it with jax[tpu] into ~/mamba_venv;
#   3. mounts the bucket read-only on every worker with gcsfuse at /mnt/gcs/<bucket>, for
#      reading prepared data only. The run's workdir is the bucket itself,
#      gs://<bucket>[/path]/runs/<run>, handed to train.py as a gs:// path: Orbax then
#      writes checkpoints with commit files (a bucket has no atomic rename, and gcsfuse
#      refuses directory renames on ordinary buckets), process 0 writes metrics, config
#      and the lock through the bucket's API, every process writes its own checkpoint
#      shards, and a restart with the same --run resumes from the last checkpoint;
#   4. starts `python train.py --workdir gs://... <train args>` on all workers at once,
#      detached (nohup; a dropped ssh session does not stop training). JAX finds the
#      other workers from the TPU metadata (mamba_train/parallel/distributed.py), so no
#      coordinator flags are needed;
#   5. streams worker 0's log (the job's log: other workers log warnings only) until
#      Ctrl-C, which stops the streaming, not the run. Every worker keeps its own
#      log in ~/mamba_train.log.
#
# Flags (each also read from the environment variable in brackets):
#   --name NAME          TPU VM name [TPU_NAME] (required)
#   --zone ZONE          zone [TPU_ZONE] (required)
#   --project PROJECT    GCP project [TPU_PROJECT] (default: gcloud's configured project)
#   --accelerator TYPE   slice type for creation, e.g. v5p-32, v5litepod-16, v6e-64
#                        [TPU_ACCELERATOR] (default v5p-8)
#   --version VERSION    TPU VM runtime image for creation [TPU_VERSION]
#                        (default v2-alpha-tpuv5; v6e wants v2-alpha-tpuv6e)
#   --spot               create a Spot slice (cheaper, can be preempted; rerun to resume)
#   --bucket gs://B[/P]  bucket (and folder) for the workdir [TPU_BUCKET] (required to train)
#   --run NAME           run name: workdir gs://B[/P]/runs/NAME [RUN_NAME] (default: date-time)
#   --skip-install       the workers already hold this tree and its venv
#   --logs               only stream worker 0's log of the current run
#   --stop               only stop the run: SIGTERM to train.py on every worker, which
#                        saves a checkpoint at the next step and exits (as on preemption)
#   --dry-run            print every gcloud command instead of running it
#   -- ARGS...           passed to train.py as they are (config and overrides)
#
# The data: pass --config.data.dir pointing at a prepared dataset on every worker,
# e.g. one prepared into the bucket (/mnt/gcs/B/data/...; read through the read-only
# gcsfuse mount) or copied to each worker's disk beforehand (faster: the loader
# memory-maps its shards). Check that a config fits the slice first:
#   python scripts/aot_compile.py --config configs/130m.py --topology v5p-32
set -euo pipefail

name=${TPU_NAME:-}
zone=${TPU_ZONE:-}
project=${TPU_PROJECT:-}
accelerator=${TPU_ACCELERATOR:-v5p-8}
version=${TPU_VERSION:-v2-alpha-tpuv5}
bucket=${TPU_BUCKET:-}
run_name=${RUN_NAME:-$(date +%Y%m%d-%H%M%S)}
spot=0
install=1
mode=train
dry_run=0
train_args=()

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "launch_tpu_pod.sh: $*" >&2; exit 2; }

while (($#)); do
  case $1 in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --accelerator) accelerator=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --bucket) bucket=$2; shift 2 ;;
    --run) run_name=$2; shift 2 ;;
    --spot) spot=1; shift ;;
    --skip-install) install=0; shift ;;
    --logs) mode=logs; shift ;;
    --stop) mode=stop; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; train_args=("$@"); break ;;
    *) die "unknown flag $1 (train.py flags go after --; see --help)" ;;
  esac
done
[[ -n $name ]] || die "--name (or TPU_NAME) is required"
[[ -n $zone ]] || die "--zone (or TPU_ZONE) is required"

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
[[ -n $project ]] && where+=(--project "$project")

# Runs a command, or prints it under --dry-run (arguments with spaces or shell
# characters in single quotes, so that the line can be pasted into a shell).
run() {
  if ((dry_run)); then
    local a out='+'
    for a in "$@"; do
      if [[ $a =~ ^[[:alnum:]_./:=@,+%-]+$ ]]; then out+=" $a"; else out+=" '${a//\'/\'\\\'\'}'"; fi
    done
    echo "$out"
  else
    "$@"
  fi
}

# Runs a shell command on every worker of the slice.
on_all_workers() { run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$1"; }

# shellcheck disable=SC2016  # these two are expanded by the workers' shell
log_file='$HOME/mamba_train.log' pid_file='$HOME/mamba_train.pid'
stream_logs() {
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=0 --command "tail -n +1 -F $log_file"
}

if [[ $mode == logs ]]; then stream_logs; exit; fi
if [[ $mode == stop ]]; then
  on_all_workers "[ -f $pid_file ] && kill -TERM \$(cat $pid_file) 2>/dev/null; rm -f $pid_file; true"
  exit
fi

[[ $bucket == gs://* ]] || die "--bucket gs://BUCKET (or TPU_BUCKET) is required to train"
bucket_path=${bucket#gs://}
bucket_path=${bucket_path%/}
bucket_name=${bucket_path%%/*}
mount_dir=/mnt/gcs/$bucket_name
workdir=gs://$bucket_path/runs/$run_name

# 1. The slice: reuse it if it exists, else create it.
if ((dry_run)) || ! "${gcloud_tpu[@]}" describe "$name" "${where[@]}" --format='value(state)' >/dev/null 2>&1; then
  create=("${gcloud_tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accelerator"
          --version "$version")
  ((spot)) && create+=(--spot)
  ((dry_run)) && echo "# if '$name' does not exist yet:"
  run "${create[@]}"
fi

# 2. The project on every worker: the committed tree, installed with jax[tpu].
if ((install)); then
  root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
  tarball=$(mktemp -t mamba_train.XXXXXX.tar.gz)
  trap 'rm -f "$tarball"' EXIT
  run git -C "$root" archive --format=tar.gz -o "$tarball" HEAD
  run "${gcloud_tpu[@]}" scp "$tarball" "$name:mamba_train.tar.gz" "${where[@]}" --worker=all
  on_all_workers "set -e; rm -rf ~/mamba_train && mkdir -p ~/mamba_train \
    && tar -xzf ~/mamba_train.tar.gz -C ~/mamba_train \
    && { [ -d ~/mamba_venv ] || python3 -m venv ~/mamba_venv; } \
    && ~/mamba_venv/bin/pip install -q -U pip \
    && ~/mamba_venv/bin/pip install -q -e ~/mamba_train'[gcs]' 'jax[tpu]'"
fi

# 3. The bucket, read-only through gcsfuse on every worker: data only (the workdir is gs://).
on_all_workers "set -e; command -v gcsfuse >/dev/null || { \
    echo 'deb https://packages.cloud.google.com/apt gcsfuse-'\$(lsb_release -c -s)' main' \
      | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null \
    && curl -fsS https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo apt-key add - \
    && sudo apt-get update -q && sudo apt-get install -y -q gcsfuse; }; \
  mountpoint -q $mount_dir || { sudo mkdir -p $mount_dir && sudo chown \$(id -u):\$(id -g) $mount_dir \
    && gcsfuse --implicit-dirs -o ro $bucket_name $mount_dir; }"

# 4. The same command on every worker, detached.
args=''
((${#train_args[@]})) && printf -v args ' %q' "${train_args[@]}"
on_all_workers "cd ~/mamba_train && { nohup ~/mamba_venv/bin/python train.py --workdir $workdir$args \
  > $log_file 2>&1 < /dev/null & echo \$! > $pid_file; }"
echo "run '$run_name' started on every worker of $name; workdir $workdir"

# 5. The job's log.
stream_logs

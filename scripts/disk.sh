# Sourced by setup.sh and setup_vllm.sh: refuse a fresh environment early, with the sizes,
# when its disk cannot hold it, instead of pip failing halfway with "No space left on device".
# need_disk WHO DIR GIB: DIR is where the environment goes (it may not exist yet).
need_disk() {
  local who=$1 dir=$2 need_gib=$3 parent free_kib
  parent=$(dirname "$(realpath -m "$dir")")
  while [ ! -d "$parent" ]; do parent=$(dirname "$parent"); done
  free_kib=$(df -Pk "$parent" | awk 'NR==2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
    printf '%s: %s needs about %s GiB of disk and %s has %s MiB free\n' \
      "$who" "$dir" "$need_gib" "$parent" $((free_kib / 1024)) >&2
    printf '%s: fix: free some space there (make test builds .venv and .venv-vllm side by side)\n' \
      "$who" >&2
    exit 1
  fi
}

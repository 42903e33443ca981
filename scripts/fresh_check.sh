#!/usr/bin/env bash
# A fresh machine, by hand (outside CI): clone this repository's committed HEAD into a temporary
# folder, make a fresh virtualenv there and activate it, then run README's two set-up commands
# exactly as written (the lines of README's first ```bash block), timing each, and print a summary.
#
#   bash scripts/fresh_check.sh                # fresh venv (python3 -m venv), fresh model cache
#   bash scripts/fresh_check.sh --system       # the machine's python3, no venv: installs into it, and its
#                                              # fastckpt then points at the kept clone (throwaway machines)
#   bash scripts/fresh_check.sh --reuse-cache  # keep ~/.cache/fastckpt (skips the ~30 s GGUF conversion)
#   bash scripts/fresh_check.sh --keep         # keep the temporary folder (logs, clone, venv)
#
# Options: --repo SRC (default: this checkout; what is cloned is its committed HEAD, not the work
# tree), --python PY (interpreter that makes the venv, default python3). Exit 0 only if every
# command exited 0. Logs: one file per command in the temporary folder (printed at the end).
set -uo pipefail

since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }  # seconds since $1
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$here mode=venv reuse_cache=0 keep=0 py=python3
while [ $# -gt 0 ]; do
  case $1 in
    --system) mode=system keep=1 ;;  # its editable install points into the clone: never delete it
    --reuse-cache) reuse_cache=1 ;;
    --keep) keep=1 ;;
    --repo) repo=$2; shift ;;
    --python) py=$2; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "fresh_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

work=$(mktemp -d "${TMPDIR:-/tmp}/fastckpt-fresh.XXXXXX")
cleanup() { if [ "$keep" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT

git clone -q "$repo" "$work/fastckpt" || { echo "fresh_check.sh: git clone $repo failed" >&2; exit 2; }
cd "$work/fastckpt" || exit 2
echo "clone: $work/fastckpt at $(git rev-parse --short HEAD)"

# README's set-up commands: every non-empty line of its first ```bash block, as written.
mapfile -t cmds < <(awk '/^```bash/{inb=1; next} inb && /^```/{exit} inb && NF' README.md)
[ ${#cmds[@]} -gt 0 ] || { echo "fresh_check.sh: no \`\`\`bash block in README.md" >&2; exit 2; }

if [ "$mode" = venv ]; then
  t0=$EPOCHREALTIME
  "$py" -m venv "$work/venv" || { echo "fresh_check.sh: $py -m venv failed" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$work/venv/bin/activate"
  venv_s=$(since "$t0")
  echo "venv: $VIRTUAL_ENV ($(python3 --version), made in $venv_s s)"
else
  echo "python: $(command -v python3) ($(python3 --version)), no venv"
fi
if [ "$reuse_cache" = 0 ]; then
  export FASTCKPT_CACHE=$work/cache   # a fresh machine has no converted model yet
fi

names=() secs=() codes=() lasts=()
i=0
for cmd in "${cmds[@]}"; do
  i=$((i + 1))
  log=$work/cmd$i.log
  echo "[$i/${#cmds[@]}] $cmd"
  t0=$EPOCHREALTIME
  bash -c "$cmd" >"$log" 2>&1
  rc=$?
  s=$(since "$t0")
  names+=("$cmd") secs+=("$s") codes+=("$rc")
  lasts+=("$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-120)")
  printf '      exit %d after %.0f s (log %s)\n' "$rc" "$s" "$log"
done

echo
echo "summary ($mode, $(python3 --version), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)):"
fail=0
for j in "${!names[@]}"; do
  printf '  %-4s %7.0f s  %s\n' "$([ "${codes[$j]}" = 0 ] && echo ok || echo FAIL)" "${secs[$j]}" "${names[$j]}"
  printf '               last line: %s\n' "${lasts[$j]}"
  [ "${codes[$j]}" = 0 ] || fail=1
done
[ "$keep" = 1 ] || echo "(logs are removed with $work; pass --keep to keep them)"
[ "$mode" = system ] && echo "note: python3's fastckpt is now the editable install of $work/fastckpt;" \
  "\`python3 -m pip install -e YOUR_CHECKOUT\` points it back"
exit $fail

#!/usr/bin/env bash
# Install the system packages the test suite needs (scripts/prereqs.txt), before the first test.
# Idempotent: a package is installed only when something it provides is missing, so a second
# run installs nothing and does not touch apt. Needs root (or sudo) and apt-get for installs.
#
#   scripts/prereqs.sh          install what is missing
#   scripts/prereqs.sh --check  list what is missing; exit 1 if anything is
set -euo pipefail
list="$(dirname "$0")/prereqs.txt"
check_only=${1:-}

# Whether one word of the [packages] table is present: a command, python3:<module>, or
# lib:<soname> (a shared library the dynamic loader finds).
present() {
  case $1 in
    python3:*) python3 -c "import ${1#python3:}" >/dev/null 2>&1 ;;
    lib:*) python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "${1#lib:}" >/dev/null 2>&1 ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}

missing=()
while read -r pkg provides; do
  for word in $provides; do
    if ! present "$word"; then missing+=("$pkg"); break; fi
  done
done < <(sed -n '/^\[packages\]/,/^\[/{/^\[/d;s/#.*//;/^[[:space:]]*$/d;p}' "$list")

if [ ${#missing[@]} -eq 0 ]; then
  echo "prereqs: every system package of $list is present"
  exit 0
fi
echo "prereqs: missing ${missing[*]}"
[ "$check_only" = --check ] && exit 1
command -v apt-get >/dev/null || {
  echo "prereqs: no apt-get here; install these packages (or their equivalents): ${missing[*]}" >&2
  exit 1
}
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "prereqs: run as root to install ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "prereqs: installed ${missing[*]} in $(( $(date +%s) - start )) s"

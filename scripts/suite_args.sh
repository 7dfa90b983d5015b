# The command line that scripts/gpu_suite.sh and scripts/sanitize.sh share, sourced by both:
#   parse_suite_args USAGE DEFAULT_DIR "NAME ..." "$@"
# takes --out DIR and any of the NAMEs, in any order, and sets `out` (DIR, created and made
# absolute, so that a relative DIR is taken from the directory the script was started in, not
# the checkout it moves to) and `chosen` (the NAMEs given, in order). Every argument is checked
# before the script runs anything: a mistyped name fails at once, not after minutes of building.
# Returns 2 after printing what was wrong and USAGE.
parse_suite_args() {
  local usage=$1 names=" $3 "
  out=$2
  chosen=()
  shift 3
  while [ $# -gt 0 ]; do
    if [ "$1" = --out ]; then
      [ $# -ge 2 ] && [ -n "$2" ] || { echo "--out needs a folder; $usage" >&2; return 2; }
      out=$2
      shift 2
    elif [[ "$names" == *" $1 "* ]]; then
      chosen+=("$1")
      shift
    else
      echo "unknown argument $1; $usage" >&2
      return 2
    fi
  done
  mkdir -p "$out" && out=$(cd "$out" && pwd)
}

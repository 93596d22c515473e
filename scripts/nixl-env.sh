# Environment for processes that use kvx-nixl against the NIXL wheel installed by
# scripts/install-nixl.sh. Source it (bash): `source scripts/nixl-env.sh`.
#   LD_LIBRARY_PATH  the wheel's library directory, so nixl-sys (`stub-api`) can dlopen
#                    libnixl_capi.so and it finds libnixl*.so next to it.
#   NIXL_PLUGIN_DIR  the wheel's plugin directory (libplugin_UCX.so, ...).
#   UCX_MODULES      '^ib*': keeps the wheel's bundled UCX from loading Debian's InfiniBand
#                    modules (libucx-dev pulls them in), which segfault at exit (libnl clash).
# Prints nothing on success; returns 1 (without exiting the shell) if the wheel is missing.

_kvx_nixl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kvx_nixl_libs=""
for _d in "$_kvx_nixl_root"/.venv-nixl/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs; do
    if [ -f "$_d/libnixl_capi.so" ]; then _kvx_nixl_libs="$_d"; fi
done
unset _d _kvx_nixl_root

if [ -z "$_kvx_nixl_libs" ]; then
    echo "nixl-env: NIXL wheel not found; run scripts/install-nixl.sh first" >&2
    unset _kvx_nixl_libs
    return 1 2>/dev/null || exit 1
fi

case ":${LD_LIBRARY_PATH:-}:" in
    *":$_kvx_nixl_libs:"*) ;;
    *) export LD_LIBRARY_PATH="$_kvx_nixl_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
export NIXL_PLUGIN_DIR="$_kvx_nixl_libs/plugins"
export UCX_MODULES="${UCX_MODULES:-^ib*}"
unset _kvx_nixl_libs

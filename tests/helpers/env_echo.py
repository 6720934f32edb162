"""`python -m tests.helpers.env_echo NAME OUT`: writes $NAME and its argv to the file OUT
(what a process started from an engine-core spare was given)."""

import json
import os
import sys

if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"value": os.environ.get(name), "argv": sys.argv, "pid": os.getpid()}, f)

"""A module the preloaded launcher's tests run as a child (`-m tests.preload_probe CODE`): it prints what a run
would depend on (argv, working directory, an environment variable, whether torch came preloaded, its thread
count) as one JSON line and exits with CODE."""

import json
import os
import sys

if __name__ == "__main__":
    if sys.argv[1:] == ["sleep"]:
        import time
        time.sleep(120)
    preloaded = "torch" in sys.modules
    import torch
    cuda = float(torch.ones(2, device="cuda").sum()) if torch.cuda.is_available() else None
    print(json.dumps({"cuda": cuda, "argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                      "torch_preloaded": preloaded, "threads": torch.get_num_threads(), "pid": os.getpid(),
                      "stdin": sys.stdin.read()}))
    sys.exit(int(sys.argv[1]))

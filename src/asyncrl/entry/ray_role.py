"""Entry point of the driver-side process that places one role on a Ray cluster and
follows it (``python -m asyncrl.entry.ray_role ...``), and of its reaper (``--reap``):
see :mod:`asyncrl.launch.ray_cluster`."""

import sys

from asyncrl.launch.ray_cluster import proxy_main, reap_main

if __name__ == "__main__":
    if sys.argv[1:2] == ["--reap"] and sys.argv[4:5] == ["--"]:
        sys.exit(reap_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[5:]))
    sys.exit(proxy_main())

"""Peak of the summed RSS (GiB) of every process whose cwd is under DIR, sampled every 2 s until DIR/.rss_stop exists.
Usage: python rss_monitor.py DIR OUT"""
import os, sys, time
root, out = os.path.realpath(sys.argv[1]), sys.argv[2]
peak = 0
while not os.path.exists(os.path.join(root, ".rss_stop")):
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if not os.path.realpath(f"/proc/{pid}/cwd").startswith(root):
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    if total > peak:
        peak = total
        with open(out, "w") as f:
            f.write(f"{peak / 2**20:.2f} GiB\n")
    time.sleep(2)

"""Host-device copy bandwidth of pinned memory on this machine: host to device, device to host,
and both at once on two streams (the device stepper's copies in and out), 2 GiB a copy, the best
of five. Prints one JSON line per direction.

    python3 scripts/pytorch/pinned_bandwidth.py [--gib 2] [--repeat 5]
"""
import argparse
import json

import torch


def timed(fn, repeat):
    best = float('inf')
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--gib', type=float, default=2.0)
    parser.add_argument('--repeat', type=int, default=5)
    args = parser.parse_args()
    n = int(args.gib * (1 << 30))
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device='cuda')
    dev_out = torch.empty(n, dtype=torch.uint8, device='cuda')
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s_in):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(s_out):
            host_out.copy_(dev_out, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s_in)
        torch.cuda.current_stream().wait_stream(s_out)

    runs = {
        'host_to_device': (lambda: dev_in.copy_(host_in, non_blocking=True), n),
        'device_to_host': (lambda: host_out.copy_(dev_out, non_blocking=True), n),
        'both_at_once': (both, 2 * n),
    }
    for name, (fn, bytes_moved) in runs.items():
        seconds = timed(fn, args.repeat)
        print(json.dumps({'copy': name, 'bytes': bytes_moved, 'seconds': seconds,
                          'gb_per_s': bytes_moved / seconds / 1e9}))


if __name__ == '__main__':
    main()

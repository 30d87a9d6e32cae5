"""The reward sandbox: runs untrusted Python against tests, isolated, honest and fast.

How a job flows: the gRPC server (`server`, `service`) validates the request
(`jobspec`) and hands the job to `executor`, which passes four descriptors to
a warm jail forked by the single-threaded zygote (`forkserver`, started and
asked by `forkserver_client`). The jail (`jail`) was
already confined for the detected tier (`tiers`: `namespaces`, `seccomp`,
`syscalls`, rlimits); its harness (`harness`) forks candidate processes
(`candidate`) that run the code, through the template (`template`) when the
job has assert programs, and writes one record per test back. The server decides the verdicts (`verdicts`) from plain values
(`plain`) and kills the job's whole process group.

Protected (strongest tier, `namespaces`):
- resources: CPU time, wall time, address space, file size, open files, output
  size; a private size- and inode-limited /tmp;
- processes: no fork or exec in the candidate (threads only), no signals to
  anything but itself, the job's process group SIGKILLed at the end, the
  zygote a subreaper for anything orphaned;
- the host: no network (empty network namespace, and seccomp refuses internet,
  netlink and datagram sockets, connect and bind), no other process visible
  (PID namespace, no /proc), a read-only minimal root with site-packages
  hidden, an empty environment, `python -I -S`, no capabilities, no ptrace;
- the reward: expected outputs never enter the jail; assert programs live
  only in the harness, never in a candidate's memory, and so does each test's
  nonce until its record is written; a candidate's results cross as plain
  values; a test passes only with a record carrying its own nonce, written
  after it ran; an exit, a printed "PASSED", a
  patched builtin or `unittest`, or an always-equal object scores 0.

Not protected: kernel bugs reachable through allowed system calls; reading
world-readable system files; below the namespaces tier, any file the sandbox
uid can read and world-writable host directories; memory held in memfds and
tmpfs pages beyond the address-space limit (bounded by the file-size and tmpfs
limits); CPU contention and timing side channels between concurrent jobs.
`marl sandbox doctor` prints the tier a machine gets and what each layer does.
"""

"""What reads the node: the kubelet's sockets and paths, the kernel's Unix socket tables (`/proc/net/unix`,
sock_diag), and the process table (which process is the kubelet: `proc`). Standard library only."""

package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// The device manager listens on a compile-time path; the fixture gives it a mount namespace of
// its own in which the test's folder is bind-mounted there.
const (
	kubeletDevicePluginDir = "/var/lib/kubelet/device-plugins"
	nsChildCommand         = "kubelet-in-namespace"
	nsEnvMarker            = "REALKUBELET_IN_NAMESPACE"
)

// enterMountNamespace re-executes this binary as nsChildCommand inside a private mount namespace.
// As root: unshare(CLONE_NEWNS) on a locked thread, then execve from that thread, so the process
// (same pid: a SIGKILL from the driver kills the kubelet itself) keeps the new namespace. Not root:
// a child in a new user namespace mapping the caller to root (like `unshare --map-root-user -m`),
// killed with this process.
func enterMountNamespace(args []string) int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "realkubelet:", err)
		return 1
	}
	// Started through a link of another name, keep that name (the process's comm): a test that
	// gives this kubelet a name of its own finds it by that name after the re-exec.
	if filepath.IsAbs(os.Args[0]) {
		self = os.Args[0]
	}
	argv := append([]string{self, nsChildCommand}, args...)
	env := append(os.Environ(), nsEnvMarker+"=1")
	if os.Geteuid() == 0 {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNS); err == nil {
			err = syscall.Exec(self, argv, env)
			fmt.Fprintln(os.Stderr, "realkubelet: exec in the new mount namespace:", err)
			return 1
		} else {
			fmt.Fprintln(os.Stderr, "realkubelet: unshare(CLONE_NEWNS) failed, trying a user namespace:", err)
		}
		runtime.UnlockOSThread()
	}
	cmd := exec.Command(self, argv[1:]...)
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWNS | syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Geteuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getegid(), Size: 1}},
		Pdeathsig:   syscall.SIGKILL,
	}
	// Pdeathsig follows the thread that forked: keep it alive for the child's life.
	runtime.LockOSThread()
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "realkubelet: cannot create a user and mount namespace:", err)
		return 1
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	err = cmd.Wait()
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		return exitErr.ExitCode()
	}
	if err != nil {
		return 1
	}
	return 0
}

// bindDevicePluginDir makes dir appear at kubeletDevicePluginDir in this (private) namespace
// without writing anything outside dir: where the path does not exist, a tmpfs is mounted on its
// deepest existing ancestor (visible only here) and the missing folders are made inside it.
func bindDevicePluginDir(dir string) error {
	if os.Getenv(nsEnvMarker) != "1" {
		return errors.New("not in the fixture's mount namespace")
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if abs == kubeletDevicePluginDir {
		return nil
	}
	// Hold the folder open: a tmpfs mounted above it must not hide it from the bind.
	fd, err := unix.Open(abs, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", abs, err)
	}
	defer unix.Close(fd)
	if st, err := os.Stat(kubeletDevicePluginDir); err != nil || !st.IsDir() {
		ancestor := filepath.Dir(kubeletDevicePluginDir)
		for {
			if st, err := os.Stat(ancestor); err == nil && st.IsDir() {
				break
			}
			ancestor = filepath.Dir(ancestor)
		}
		if err := unix.Mount("tmpfs", ancestor, "tmpfs", 0, "mode=0755"); err != nil {
			return fmt.Errorf("mount a private tmpfs on %s: %w", ancestor, err)
		}
		if err := os.MkdirAll(kubeletDevicePluginDir, 0o750); err != nil {
			return err
		}
	}
	src := fmt.Sprintf("/proc/self/fd/%d", fd)
	if err := unix.Mount(src, kubeletDevicePluginDir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s at %s: %w", abs, kubeletDevicePluginDir, err)
	}
	return nil
}

//! Child processes with bounds: waiting for one to exit without polling (the wait runs on a
//! thread and the caller waits on its answer), and [`SelfChild`], this executable started again
//! in another role that announces itself in lines on its stdout.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use kvx_core::{Error, ErrorKind, Result};

/// Waits for `child` to exit, at most `limit`. A child still running then is killed (`SIGKILL`)
/// and reaped, and `None` is returned; so is a child whose status cannot be read.
pub fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let pid = child.id();
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel();
        scope.spawn(move || {
            let _ = tx.send(child.wait());
        });
        match rx.recv_timeout(limit) {
            Ok(status) => status.ok(),
            Err(_) => {
                // Not reaped while the wait above runs, so the id is still this child's. Once it
                // is killed, that wait returns and the scope ends.
                let _ = Command::new("kill").args(["-s", "KILL", &pid.to_string()]).status();
                None
            }
        }
    })
}

/// A command (words separated by white space) that [`SelfChild::spawn_peer`] puts before this
/// executable: how a bench runs its peer in another network namespace.
pub const PEER_WRAPPER_ENV: &str = "KVX_BENCH_PEER_WRAPPER";

/// The address a bench's processes listen on and advertise (default 127.0.0.1): set per process
/// by a [`PEER_WRAPPER_ENV`] wrapper, so that each end of a veth pair uses its own.
pub const HOST_ENV: &str = "KVX_BENCH_HOST";

/// [`HOST_ENV`], or 127.0.0.1.
pub fn bench_host() -> String {
    std::env::var(HOST_ENV).unwrap_or_else(|_| "127.0.0.1".to_owned())
}

/// This executable started again in another role (selected by `args` and the environment), its
/// stdout read line by line on a thread; killed on drop if still running.
#[derive(Debug)]
pub struct SelfChild {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl SelfChild {
    /// Starts this executable with `args` and `envs` added to this process's environment; its
    /// stderr is this process's, its stdin a pipe that [`close_stdin`](Self::close_stdin) closes.
    pub fn spawn(args: &[&str], envs: &[(&str, &str)]) -> Result<SelfChild> {
        let exe = std::env::current_exe().map_err(|e| io_error("current_exe", e))?;
        Self::start(Command::new(exe), args, envs)
    }

    /// As [`spawn`](Self::spawn), for the other end of a measured link (a bench's target, its
    /// stream's sender): where [`PEER_WRAPPER_ENV`] is set, its words come first, so that the
    /// peer can run elsewhere (`ip netns exec B env KVX_BENCH_HOST=10.0.0.2`); the wrapper must
    /// exec this executable in place (its pid is the child's).
    pub fn spawn_peer(args: &[&str], envs: &[(&str, &str)]) -> Result<SelfChild> {
        let exe = std::env::current_exe().map_err(|e| io_error("current_exe", e))?;
        let wrapper = std::env::var(PEER_WRAPPER_ENV).unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let command = match words.next() {
            None => Command::new(exe),
            Some(first) => {
                let mut command = Command::new(first);
                command.args(words).arg(exe);
                command
            }
        };
        Self::start(command, args, envs)
    }

    fn start(mut command: Command, args: &[&str], envs: &[(&str, &str)]) -> Result<SelfChild> {
        let mut child = command
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| io_error("starting a child process", e))?;
        let Some(stdout) = child.stdout.take() else {
            return Err(Error::new(ErrorKind::Io, "child process without stdout"));
        };
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Ok(SelfChild { child, stdin, lines })
    }

    /// Closes the child's stdin: a child that waits for its end goes on.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The rest of the next stdout line that contains `prefix` (other lines are skipped: libtest
    /// may print its own text before it on the same line), within `limit`.
    pub fn wait_line(&mut self, prefix: &str, limit: Duration) -> Result<String> {
        let deadline = Instant::now() + limit;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if let Some(at) = line.find(prefix) {
                        return Ok(line[at + prefix.len()..].trim().to_owned());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("child printed no {prefix:?} within {limit:?}"),
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!("child exited before printing {prefix:?}: {:?}", self.child.try_wait()),
                    ));
                }
            }
        }
    }

    /// Waits, within `limit` in all, for the child to close its stdout and exit successfully.
    pub fn wait_success(mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(_) => {}
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("child still running after {limit:?}"),
                    ));
                }
            }
        }
        match wait_within(&mut self.child, deadline.saturating_duration_since(Instant::now())) {
            Some(status) if status.success() => Ok(()),
            Some(status) => Err(Error::new(ErrorKind::Io, format!("child process failed: {status}"))),
            None => Err(Error::new(ErrorKind::Timeout, format!("child did not exit within {limit:?}"))),
        }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The CPU time the child's live threads have run so far.
    pub fn cpu_time(&self) -> Result<Duration> {
        cpu_time(&format!("/proc/{}/task", self.id()))
    }
}

/// The CPU time this process's live threads have run so far.
pub fn own_cpu_time() -> Result<Duration> {
    cpu_time("/proc/self/task")
}

/// The sum over a process's threads of the time each has run (`/proc/<pid>/task/*/schedstat`,
/// nanoseconds; a thread that ended takes its time with it, so measure across spans where the
/// threads that do the work live).
fn cpu_time(tasks: &str) -> Result<Duration> {
    let io = |e: std::io::Error| Error::new(ErrorKind::Io, format!("{tasks}: {e}"));
    let mut total = 0u64;
    for task in std::fs::read_dir(tasks).map_err(io)? {
        let path = task.map_err(io)?.path().join("schedstat");
        // A thread may end between the listing and the read: it no longer counts.
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let ran = text.split_whitespace().next().and_then(|ns| ns.parse::<u64>().ok());
        total += ran.ok_or_else(|| Error::new(ErrorKind::Io, format!("{}: {text:?}", path.display())))?;
    }
    Ok(Duration::from_nanos(total))
}

impl Drop for SelfChild {
    fn drop(&mut self) {
        // A failed test or bench must not leave the child behind.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn io_error(what: &str, e: std::io::Error) -> Error {
    Error::new(ErrorKind::Io, format!("{what}: {e}")).with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_is_seen_and_an_overdue_child_is_killed() {
        let mut quick = Command::new("true").spawn().unwrap_or_else(|e| panic!("spawning true: {e}"));
        let status = wait_within(&mut quick, Duration::from_secs(60));
        assert!(status.is_some_and(|s| s.success()), "{status:?}");
        let mut stuck = Command::new("sleep").arg("600").spawn().unwrap_or_else(|e| panic!("spawning: {e}"));
        assert_eq!(wait_within(&mut stuck, Duration::ZERO), None);
        assert!(matches!(stuck.try_wait(), Ok(Some(_))), "killed and reaped");
    }

    #[test]
    fn cpu_time_grows_with_work_and_a_gone_process_is_an_error() {
        let start = own_cpu_time().unwrap_or_else(|e| panic!("{e}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while own_cpu_time().unwrap_or_else(|e| panic!("{e}")) < start + Duration::from_millis(5) {
            assert!(Instant::now() < deadline, "5 ms of CPU not counted after 30 s of spinning");
            std::hint::spin_loop();
        }
        assert_eq!(cpu_time("/proc/0/task").map_err(|e| e.kind()), Err(ErrorKind::Io));
    }
}

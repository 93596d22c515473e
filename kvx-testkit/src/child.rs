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
        let mut child = Command::new(exe)
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
}

//! Waiting for a child process with a bound, without polling: the wait runs on a thread and the
//! caller waits on its answer.

use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::Duration;

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

//! A reader and a target in two processes over TCP: this binary re-executes itself as the target,
//! which passes its metadata back on stdout; the reader READs 1000 scattered 64 KiB blocks three
//! times (each one transfer with a notification), waiting on its agent rather than polling, and
//! checks every byte. Then once more with the deployment's key on both sides. The target exits
//! once the reader's DONE arrives, having received every notification from the reader alone.
#![allow(clippy::unwrap_used)] // Test code: panics are failures.

use std::sync::Arc;
use std::time::Duration;

use kvx_core::{AuthKey, HostMemory, KvMemory};
use kvx_tcp::{TcpAgent, TcpConfig};
use kvx_testkit::xproc::{self, DONE, Idle, Reader, TRANSFER_DEADLINE, Target, TargetSetup};

const KEY: &[u8] = b"kvx-tcp two-process test key, 32 bytes";

fn config(keyed: bool) -> TcpConfig {
    TcpConfig::default().with_auth_key(keyed.then(|| AuthKey::new(KEY).unwrap()))
}

/// The target role: does nothing unless this process was started as a target.
#[test]
fn two_process_target_role() {
    xproc::run_target_if_child(|spec| {
        let agent = TcpAgent::with_config("two-process-target", &config(spec == "keyed")).unwrap();
        let memory = Arc::new(HostMemory::new(xproc::TARGET_BLOCKS * xproc::BLOCK_LEN).unwrap());
        xproc::fill_target(|offset, bytes| memory.write(offset, bytes)).unwrap();
        // The agent's I/O threads serve the READs: park between drains, off the CPUs.
        let memory: Arc<dyn KvMemory> = memory;
        TargetSetup { agent, memory, idle: Idle::Park(Duration::from_millis(1)) }
    });
}

fn read_across_processes(keyed: bool, name: &str) {
    let spec = if keyed { "keyed" } else { "open" };
    let target =
        Target::spawn(&["--exact", "two_process_target_role", "--nocapture", "--test-threads=1"], spec);
    let reader =
        Reader::new(TcpAgent::with_config(name, &config(keyed)).unwrap(), &target.metadata, target.base);
    for round in 0..3 {
        reader.clear();
        let note = (round == 2).then_some(DONE);
        let wait = &mut |x| reader.agent.wait(x, TRANSFER_DEADLINE).map(drop);
        reader.try_read_round(round, note, wait).unwrap();
        reader.verify(round);
    }
    assert_eq!(target.finish(name), 1, "the target got exactly the final READ's notification");
    let stats = reader.agent.stats();
    assert_eq!(stats.connections_dropped, 0, "{stats:?}");
}

#[test]
fn two_process_reads() {
    read_across_processes(false, "reader");
}

#[test]
fn two_process_reads_with_a_key() {
    read_across_processes(true, "reader-keyed");
}

//! `--metrics-port`: the engine's Prometheus metrics on `http://HOST:PORT/metrics` while the role
//! runs, and with `--metrics-linger` until the first scrape after it finished.

use clap::Args;
use std::time::Duration;
use tokio::runtime::Runtime;

use kvx_core::Result;
use kvx_net::metrics::{Metrics, MetricsServer, serve};
use kvx_testkit::sim::{EngineMetrics, SimEngine};

use super::runtime;

/// Options of the metrics endpoint.
#[derive(Debug, Clone, Args)]
pub(crate) struct MetricsArgs {
    /// Serve Prometheus metrics on http://HOST:PORT/metrics while running, HOST being --host
    /// (0: a free port, printed on start).
    #[arg(long)]
    metrics_port: Option<u16>,
    /// After the run, keep serving /metrics until it is scraped once more (the final values), at
    /// most this many seconds.
    #[arg(long, default_value_t = 0, requires = "metrics_port")]
    metrics_linger: u64,
}

/// The endpoint of one role, or nothing without `--metrics-port`.
#[derive(Debug)]
pub(crate) struct RoleMetrics(Option<Serving>);

#[derive(Debug)]
struct Serving {
    engine: EngineMetrics,
    server: MetricsServer,
    linger: Duration,
    /// Runs the server; dropped last.
    rt: Runtime,
}

impl RoleMetrics {
    /// Starts serving `engine`'s metrics (labelled `role`) on `host`, if asked to.
    pub(crate) fn start(args: &MetricsArgs, role: &str, host: &str, engine: &SimEngine) -> Result<Self> {
        let Some(port) = args.metrics_port else { return Ok(RoleMetrics(None)) };
        let metrics = Metrics::with_role(role);
        let rt = runtime()?;
        let server = rt.block_on(serve(host, port, metrics.registry()))?;
        println!("kvx {role}: metrics on http://{}/metrics", server.local_addr());
        let mut engine_metrics = EngineMetrics::new(&metrics, engine);
        engine_metrics.observe(engine);
        let linger = Duration::from_secs(args.metrics_linger);
        Ok(RoleMetrics(Some(Serving { engine: engine_metrics, server, linger, rt })))
    }

    /// Brings the metrics up to date (once per step).
    pub(crate) fn observe(&mut self, engine: &SimEngine) {
        if let Some(s) = &mut self.0 {
            s.engine.observe(engine);
        }
    }

    /// The run is over: the final values, then with `--metrics-linger`, serving until the next
    /// scrape (or the linger's end) and a graceful stop, so that scrape gets its answer.
    pub(crate) fn finish(self, role: &str, engine: &SimEngine) {
        let Some(mut s) = self.0 else { return };
        s.engine.observe(engine);
        if s.linger.is_zero() {
            return;
        }
        // Counted before saying so: a scrape that comes at once is the one waited for.
        let scrapes = s.server.scrapes();
        let addr = s.server.local_addr();
        println!(
            "kvx {role}: final metrics on http://{addr}/metrics (served until scraped, at most {:?})",
            s.linger
        );
        let served = s.rt.block_on(async {
            let scraped = s.server.wait_for_scrape(scrapes, s.linger).await;
            s.server.shutdown(Duration::from_secs(5)).await.and(scraped)
        });
        if let Err(e) = served {
            eprintln!("kvx {role}: {e}");
        }
    }
}

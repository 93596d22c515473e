//! kvx's [`MetadataExchange`] over etcd: engines find each other by engine id instead of a host and
//! port in every request.
//!
//! Each worker publishes its handshake payload under `{prefix}/{engine_id}/{rank}`, attached to an
//! etcd lease that a background task keeps alive. When the engine dies, the keep-alives stop and
//! etcd deletes the entry once the lease's TTL has passed; when it closes, it revokes the lease and
//! the entry goes at once. A restarted engine's publish replaces the value (and moves the key to
//! its own lease). A decode worker fetches the key of the prefill engine's matching rank: a
//! prefill engine whose params carry no `remote_host`/`remote_port` is found by id alone.
//!
//! With the deployment's key ([`EtcdConfig::auth_key`]), each entry is the payload behind an
//! HMAC-SHA256 tag over the entry's key and the payload: a fetch refuses (`Unauthenticated`) an
//! entry written without the key, or copied from another engine's or rank's key. Without a key,
//! whoever can write under the prefix can hand decode engines a payload: protect the prefix with
//! etcd's own access control. etcd does not encrypt here either: the client speaks plain HTTP/2.

mod url;

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions, PutOptions};
use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use kvx_core::auth::{Purpose, TAG_LEN};
use kvx_core::error::quote;
use kvx_core::{AuthKey, EngineId, Error, ErrorKind, MetadataExchange, PeerLocator, Result};
use kvx_net::{NetConfig, max_payload};

pub use url::{EtcdUrl, SCHEME};

/// Settings of an [`EtcdExchange`].
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// The etcd cluster.
    pub url: EtcdUrl,
    /// The key prefix of the deployment's entries (engines of one deployment share it).
    pub prefix: String,
    /// The lease's time to live: a dead engine's entry disappears at most this long after its
    /// last keep-alive (whole seconds, at least one; kept alive every third of it).
    pub lease_ttl: Duration,
    /// The bound of connecting and of every etcd request.
    pub timeout: Duration,
    /// The largest payload published or accepted, in bytes.
    pub max_payload: usize,
    /// The deployment's shared key: entries carry a tag under it, and entries without a valid
    /// one are refused. `None`: entries are the bare payloads.
    pub auth_key: Option<AuthKey>,
}

impl EtcdConfig {
    /// The defaults: prefix `/kvx/handshake`, a 10 s lease, 5 s requests, and the TCP side
    /// channel's payload limit (under etcd's own request limit, `--max-request-bytes`, 1.5 MiB by
    /// default, a larger payload fails at the put).
    pub fn new(url: EtcdUrl) -> Self {
        EtcdConfig {
            url,
            prefix: "/kvx/handshake".into(),
            lease_ttl: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            max_payload: max_payload(&NetConfig::default()),
            auth_key: None,
        }
    }

    /// The key of `rank` of `engine_id`.
    pub fn key(&self, engine_id: &EngineId, rank: u32) -> String {
        format!("{}/{}/{rank}", self.prefix.trim_end_matches('/'), engine_id.as_str())
    }

    /// The entry stored under `key` for `payload`: with a key, its tag over both, then the
    /// payload.
    fn seal(&self, key: &str, payload: Vec<u8>) -> Vec<u8> {
        match &self.auth_key {
            Some(auth) => {
                [&auth.tag(Purpose::RegistryEntry, &[key.as_bytes(), &payload])[..], &payload].concat()
            }
            None => payload,
        }
    }

    /// The payload of the entry stored under `key`, once its size (and with a key, its tag)
    /// checks.
    fn open<'a>(&self, key: &str, entry: &'a [u8]) -> Result<&'a [u8]> {
        let tag_len = if self.auth_key.is_some() { TAG_LEN } else { 0 };
        if entry.len() > self.max_payload.saturating_add(tag_len) {
            return Err(Error::invalid_peer_data(format!(
                "{} holds {} bytes, over the limit of {} bytes",
                quote(key),
                entry.len(),
                self.max_payload
            )));
        }
        let Some(auth) = &self.auth_key else { return Ok(entry) };
        let (tag, payload) = entry.split_at_checked(TAG_LEN).ok_or_else(|| {
            Error::new(
                ErrorKind::Unauthenticated,
                format!("{} holds no tag, and this engine requires one", quote(key)),
            )
        })?;
        auth.verify(Purpose::RegistryEntry, &[key.as_bytes(), payload], tag)
            .map_err(|e| e.context(format!("the etcd entry {}", quote(key))))?;
        Ok(payload)
    }

    fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX)
    }
}

/// One worker's [`MetadataExchange`] over etcd (see the crate's documentation). Created inside a
/// tokio runtime that keeps running while it lives: its lease's keep-alive runs there.
pub struct EtcdExchange {
    client: Client,
    config: EtcdConfig,
    key: String,
    runtime: Handle,
    lease: Mutex<Option<Lease>>,
}

/// The lease this worker's entry is attached to, and the task that keeps it alive.
#[derive(Debug)]
struct Lease {
    id: i64,
    keep_alive: JoinHandle<()>,
}

impl fmt::Debug for EtcdExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdExchange")
            .field("url", &self.config.url.to_string())
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// `what` bounded by `timeout`: etcd's errors as `kind`, the bound as `Timeout`.
async fn bounded<T>(
    timeout: Duration,
    kind: ErrorKind,
    what: impl fmt::Display,
    call: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Error::new(kind, format!("etcd: {what}: {e}")).with_source(e)),
        Err(_) => Err(Error::new(ErrorKind::Timeout, format!("etcd: {what}: no answer within {timeout:?}"))),
    }
}

impl EtcdExchange {
    /// Connects to the cluster for `rank` of `engine_id` and checks that it answers (bounded by
    /// `config.timeout`: an unreachable cluster is a `Timeout` or `Io` error). Publishes nothing
    /// yet. Must be called within a tokio runtime.
    pub async fn connect(config: EtcdConfig, engine_id: &EngineId, rank: u32) -> Result<Self> {
        let runtime = Handle::try_current()
            .map_err(|_| Error::invalid_argument("EtcdExchange::connect needs a tokio runtime"))?;
        let options = ConnectOptions::new().with_connect_timeout(config.timeout).with_timeout(config.timeout);
        let endpoints = config.url.client_endpoints();
        let connect = Client::connect(endpoints, Some(options));
        let mut client =
            bounded(config.timeout, ErrorKind::Io, format!("connecting to {}", config.url), connect).await?;
        // The client connects lazily: ask the cluster once, so a wrong URL fails here.
        bounded(config.timeout, ErrorKind::Io, format!("reaching {}", config.url), client.status()).await?;
        let key = config.key(engine_id, rank);
        Ok(EtcdExchange { client, config, key, runtime, lease: Mutex::new(None) })
    }

    /// The key this worker publishes under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease this worker's entry is attached to, once published.
    pub fn lease_id(&self) -> Option<i64> {
        self.lease.lock().ok()?.as_ref().map(|l| l.id)
    }

    /// Revokes the lease (the entry disappears at once) and stops its keep-alive; bounded by
    /// the configured timeout. Dropping the exchange does the same without waiting.
    pub async fn close(&self) -> Result<()> {
        let Some(lease) = self.take_lease()? else { return Ok(()) };
        lease.keep_alive.abort();
        let mut client = self.client.clone();
        bounded(self.config.timeout, ErrorKind::Io, "revoking the lease", client.lease_revoke(lease.id))
            .await?;
        Ok(())
    }

    /// The lease slot.
    fn slot(&self) -> Result<std::sync::MutexGuard<'_, Option<Lease>>> {
        self.lease.lock().map_err(|_| Error::new(ErrorKind::State, "lease lock poisoned"))
    }

    fn take_lease(&self) -> Result<Option<Lease>> {
        Ok(self.slot()?.take())
    }

    /// The current lease, granted (and its keep-alive started) on the first call.
    async fn lease(&self) -> Result<i64> {
        {
            let mut slot = self.slot()?;
            match slot.as_ref() {
                Some(lease) if !lease.keep_alive.is_finished() => return Ok(lease.id),
                // Its keep-alive ended: etcd let the lease expire. Grant another.
                Some(_) => *slot = None,
                None => {}
            }
        }
        let mut client = self.client.clone();
        let ttl = self.config.ttl_secs();
        let grant =
            bounded(self.config.timeout, ErrorKind::Io, "granting a lease", client.lease_grant(ttl, None))
                .await?;
        let id = grant.id();
        let keep_alive =
            self.runtime.spawn(keep_alive(client, id, self.config.lease_ttl, self.config.timeout));
        let mut slot = self.slot()?;
        if let Some(other) = slot.as_ref().filter(|l| !l.keep_alive.is_finished()) {
            // A concurrent publish granted one first: use it, let this one lapse.
            keep_alive.abort();
            return Ok(other.id);
        }
        *slot = Some(Lease { id, keep_alive });
        debug!(key = %self.key, lease = id, ttl, "etcd lease granted");
        Ok(id)
    }

    /// Whether etcd still knows lease `id` (when it cannot say: assumed so).
    async fn lease_alive(&self, id: i64) -> bool {
        let mut client = self.client.clone();
        let ask = client.lease_time_to_live(id, None);
        bounded(self.config.timeout, ErrorKind::Io, "asking for a lease", ask)
            .await
            .ok()
            .is_none_or(|r| r.ttl() > 0)
    }

    /// Drops lease `id` (expired or revoked behind this exchange's back), if it is the current one.
    fn forget_lease(&self, id: i64) -> Result<()> {
        if let Some(lease) = self.slot()?.take_if(|l| l.id == id) {
            lease.keep_alive.abort();
        }
        Ok(())
    }

    /// Puts `entry` under this worker's key on lease `lease`.
    async fn put(&self, entry: Vec<u8>, lease: i64) -> Result<()> {
        let mut client = self.client.clone();
        let put = client.put(self.key.as_str(), entry, Some(PutOptions::new().with_lease(lease)));
        bounded(self.config.timeout, ErrorKind::Io, format!("publishing {}", self.key), put).await?;
        Ok(())
    }
}

/// Keeps lease `id` alive every third of its TTL until aborted. A failed keep-alive is retried
/// at the next tick; a lease etcd no longer knows (TTL 0: it expired, say after a partition longer
/// than the TTL) ends the task with a warning, and the entry is gone until the next publish
/// (which grants a new lease).
async fn keep_alive(mut client: Client, id: i64, ttl: Duration, timeout: Duration) {
    let period = (ttl / 3).max(Duration::from_millis(100));
    let mut ticks = tokio::time::interval(period);
    let mut stream = None;
    loop {
        ticks.tick().await;
        if stream.is_none() {
            match bounded(timeout, ErrorKind::Io, "keep-alive", client.lease_keep_alive(id)).await {
                Ok(opened) => stream = Some(opened),
                Err(e) => {
                    warn!(lease = id, error = %e, "etcd keep-alive failed; retrying");
                    continue;
                }
            }
        }
        let Some((keeper, responses)) = stream.as_mut() else { continue };
        let answer = async {
            keeper.keep_alive().await?;
            responses.message().await
        };
        match bounded(timeout, ErrorKind::Io, "keep-alive", answer).await {
            Ok(Some(r)) if r.ttl() > 0 => {}
            Ok(Some(_)) => {
                warn!(lease = id, "etcd lease expired: this worker's entry is gone");
                return;
            }
            Ok(None) | Err(_) => {
                warn!(lease = id, "etcd keep-alive stream ended; reopening");
                stream = None;
            }
        }
    }
}

impl Drop for EtcdExchange {
    fn drop(&mut self) {
        let Ok(Some(lease)) = self.take_lease() else { return };
        lease.keep_alive.abort();
        let (mut client, timeout) = (self.client.clone(), self.config.timeout);
        // Best effort: a runtime that is shutting down runs nothing, and the lease then expires.
        self.runtime.spawn(async move {
            let _ = tokio::time::timeout(timeout, client.lease_revoke(lease.id)).await;
        });
    }
}

#[async_trait]
impl MetadataExchange for EtcdExchange {
    async fn publish(&self, payload: Vec<u8>) -> Result<()> {
        let max = self.config.max_payload;
        if payload.len() > max {
            return Err(Error::invalid_argument(format!(
                "a payload of {} bytes is over the etcd exchange's limit ({max} bytes)",
                payload.len()
            )));
        }
        let entry = self.config.seal(&self.key, payload);
        let lease = self.lease().await?;
        match self.put(entry.clone(), lease).await {
            // The lease expired or was revoked before the keep-alive noticed: publish on a new one.
            Err(e) if !self.lease_alive(lease).await => {
                warn!(key = %self.key, lease, error = %e, "etcd lease gone; publishing on a new one");
                self.forget_lease(lease)?;
                let lease = self.lease().await?;
                self.put(entry, lease).await
            }
            done => done,
        }
    }

    async fn fetch(&self, peer: &PeerLocator, timeout: Duration) -> Result<Vec<u8>> {
        let key = self.config.key(&peer.engine_id, peer.rank);
        let mut client = self.client.clone();
        let what = format!("fetching {}", quote(&key));
        let got = bounded(timeout, ErrorKind::Handshake, what, client.get(key.as_str(), None)).await?;
        let Some(entry) = got.kvs().first() else {
            return Err(Error::new(
                ErrorKind::Handshake,
                format!(
                    "engine {} rank {} is not registered in etcd (no key {})",
                    quote(peer.engine_id.as_str()),
                    peer.rank,
                    quote(&key)
                ),
            ));
        };
        Ok(self.config.open(&key, entry.value())?.to_vec())
    }
}

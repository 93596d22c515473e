//! The scheduler-side connector (vLLM's EngineCore process): kvx-core's [`ConnectorScheduler`]
//! with vLLM's arguments.

use kvx_core::{
    AuthKey, BlockId, ConnectorScheduler, Endpoint, Error, ErrorKind, FailedRecv, FinishReason, Finished,
    GroupBlocks, HostScope, RequestId, SchedulerConfig, TransferParams, wire,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::py_err;

/// kvx's scheduler-side connector for one engine.
///
/// `kv_transfer_params` cross as JSON text (`json.dumps` of the request's dict); the metadata for
/// the workers crosses as bytes (kvx's wire encoding).
#[pyclass(module = "kvx_vllm")]
#[derive(Debug)]
pub struct Scheduler {
    inner: ConnectorScheduler,
}

/// The request's params, or `Err(())` when a client sent params kvx cannot read. Those come
/// from a client, so they never raise into vLLM's EngineCore (which would take the engine down):
/// the request is served without a transfer, and a warning says why.
fn params(request_id: &str, json: Option<&str>) -> Result<Option<TransferParams>, ()> {
    json.map(TransferParams::from_json).transpose().map_err(|e| {
        tracing::warn!(request_id = %kvx_core::error::quote(request_id), error = %e, "kv_transfer_params ignored");
    })
}

/// A request's blocks of each KV-cache group as `(first block position, ids)` pairs, as the
/// Python connector passes them (built by [`vllm_block_groups`]).
type GroupPairs = Vec<(u32, Vec<BlockId>)>;

fn group_blocks(pairs: GroupPairs) -> Vec<GroupBlocks> {
    pairs.into_iter().map(|(first, ids)| GroupBlocks::new(first, ids)).collect()
}

/// vLLM's null block: the id its hybrid allocator puts where a sliding-window group holds no
/// block (positions before its window).
const NULL_BLOCK: BlockId = 0;

/// vLLM's block ids of a request, one list per KV-cache group with entry `p` holding the tokens
/// of block position `p`, as `(first position, ids)` per group: from position `from` on, past
/// the leading null blocks (a sliding-window group's out-of-window positions), up to the next
/// null block if any (vLLM leaves none inside the window; blocks after one would not be the
/// window's contiguous run).
///
/// Prefill side (`request_finished_all_groups`): `from` 0. Decode side
/// (`update_state_after_alloc`): `from` is the block position of the first token not computed
/// locally, so the local prefix hit's blocks are left out.
#[pyfunction]
pub fn vllm_block_groups(block_ids: Vec<Vec<BlockId>>, from: u32) -> GroupPairs {
    block_ids
        .into_iter()
        .map(|ids| {
            let from_here = ids.get(from as usize..).unwrap_or_default();
            let nulls = from_here.iter().take_while(|&&b| b == NULL_BLOCK).count();
            let run = from_here[nulls..].iter().copied().take_while(|&b| b != NULL_BLOCK).collect();
            (from.saturating_add(u32::try_from(nulls).unwrap_or(u32::MAX)), run)
        })
        .collect()
}

/// The KV-cache groups' windows (tokens, `None` for full attention): a window of 0 tokens is
/// refused.
fn group_windows(windows: Vec<Option<u32>>) -> PyResult<Vec<Option<u32>>> {
    if let Some(g) = windows.iter().position(|w| *w == Some(0)) {
        return Err(PyValueError::new_err(format!("KV-cache group {g}: a sliding window of 0 tokens")));
    }
    Ok(windows)
}

/// A lease (`kv_lease_duration`) in seconds: positive and finite.
pub(crate) fn lease_duration(secs: f64) -> PyResult<std::time::Duration> {
    if secs.is_nan() || secs <= 0.0 {
        return Err(PyValueError::new_err(format!("kv_lease_duration must be positive, not {secs}")));
    }
    std::time::Duration::try_from_secs_f64(secs)
        .map_err(|e| PyValueError::new_err(format!("kv_lease_duration {secs}: {e}")))
}

/// The deployment's shared key, from `kv_connector_extra_config["auth_key"]` or `KVX_AUTH_KEY`.
pub fn auth_key(key: Option<&str>) -> PyResult<Option<AuthKey>> {
    key.filter(|k| !k.is_empty()).map(AuthKey::new).transpose().map_err(py_err)
}

#[pymethods]
impl Scheduler {
    /// A scheduler for engine `engine_id` whose workers serve their side channels at
    /// `side_channel_host:side_channel_port + rank`, or, with `discovery` an etcd URL, publish
    /// their payloads in etcd: then the params it hands out carry no host or port.
    /// With `auth_key`, the params it hands out carry a MAC that the decode engines check.
    /// `lease_duration_s` is the deployment's `kv_lease_duration`: as a decode engine, it renews
    /// the leases of requests waiting for their KV every sixth of it. `tp_size` is the engine's
    /// tensor-parallel size, named in the params it hands out. `group_windows` has one entry per
    /// KV-cache group of vLLM's `kv_cache_config` (hybrid allocator on): the group's sliding
    /// window in tokens, `None` for full attention; empty (the default) is one full-attention
    /// group.
    #[new]
    #[pyo3(signature = (engine_id, block_size, side_channel_host, side_channel_port, *, auth_key = None,
        lease_duration_s = 30.0, discovery = None, tp_size = 1, group_windows = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        engine_id: String,
        block_size: u32,
        side_channel_host: String,
        side_channel_port: u16,
        auth_key: Option<&str>,
        lease_duration_s: f64,
        discovery: Option<&str>,
        tp_size: u32,
        group_windows: Vec<Option<u32>>,
    ) -> PyResult<Self> {
        let side_channel = match crate::discovery::etcd_url(discovery)? {
            Some(_) => None,
            None => Some(Endpoint::new(side_channel_host, side_channel_port)),
        };
        let config = SchedulerConfig {
            engine_id: engine_id.into(),
            block_size,
            side_channel,
            auth_key: self::auth_key(auth_key)?,
            lease_duration: lease_duration(lease_duration_s)?,
            instance: None,
            tp_size,
            group_windows: self::group_windows(group_windows)?,
        };
        let inner = ConnectorScheduler::new(config).map_err(py_err)?;
        Ok(Scheduler { inner })
    }

    /// Prefill side: the instance this engine's workers publish (each worker start draws one;
    /// vLLM hands it over from the worker processes through its handshake-metadata hooks). The
    /// params then name it, so a decode worker still connected to an earlier instance of this
    /// engine handshakes again before it reads. Only before the first request.
    fn set_instance(&mut self, instance: u64) -> PyResult<()> {
        if !self.inner.is_idle() {
            return Err(PyValueError::new_err("the instance is set before the first request"));
        }
        self.inner.set_instance(Some(instance));
        Ok(())
    }

    /// vLLM added a request (its `on_new_request` hook). Decode side: a request whose params
    /// load KV from a prefill engine has its lease renewed (heartbeats in the metadata) until its
    /// load is reported or it finishes. Params kvx cannot read are skipped here; the later hooks
    /// warn about them.
    #[pyo3(signature = (request_id, params_json))]
    fn on_new_request(&mut self, request_id: &str, params_json: Option<&str>) {
        let params = params_json.and_then(|json| TransferParams::from_json(json).ok());
        self.inner.on_new_request(&RequestId::new(request_id), params.as_ref());
    }

    /// `(tokens to load, load asynchronously)`. Free of side effects.
    #[pyo3(signature = (request_id, prompt_len, params_json, num_computed_tokens))]
    fn get_num_new_matched_tokens(
        &self,
        request_id: &str,
        prompt_len: usize,
        params_json: Option<&str>,
        num_computed_tokens: usize,
    ) -> PyResult<(usize, bool)> {
        let Ok(p) = params(request_id, params_json) else { return Ok((0, false)) };
        let m = self
            .inner
            .get_num_new_matched_tokens(
                &RequestId::new(request_id),
                prompt_len,
                p.as_ref(),
                num_computed_tokens,
            )
            .map_err(py_err)?;
        Ok((m.count, m.load_async))
    }

    /// Records the blocks allocated for the request: per KV-cache group, `(first position, ids)`
    /// of its blocks from the first position not computed locally on (see
    /// [`vllm_block_groups`]). Returns whether the caller must turn the request's
    /// `do_remote_prefill` off.
    #[pyo3(signature = (request_id, prompt_len, params_json, block_groups, num_computed_tokens, num_external_tokens))]
    fn update_state_after_alloc(
        &mut self,
        request_id: &str,
        prompt_len: usize,
        params_json: Option<&str>,
        block_groups: GroupPairs,
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> PyResult<bool> {
        // Unreadable params load nothing: turn the flag off so vLLM does not ask again.
        let Ok(mut p) = params(request_id, params_json) else { return Ok(true) };
        let was = p.as_ref().is_some_and(|p| p.do_remote_prefill);
        self.inner
            .update_state_after_alloc(
                &RequestId::new(request_id),
                prompt_len,
                p.as_mut(),
                &group_blocks(block_groups),
                num_computed_tokens,
                num_external_tokens,
            )
            .map_err(py_err)?;
        Ok(was && !p.is_some_and(|p| p.do_remote_prefill))
    }

    /// `(delay_free, kv_transfer_params as JSON or None)`. `reason` is one of "length",
    /// "stop", "abort", "error". `block_groups`: the request's blocks per KV-cache group as
    /// `(first position, ids)` (see [`vllm_block_groups`]).
    #[pyo3(signature = (request_id, params_json, reason, num_computed_tokens, block_groups))]
    fn request_finished(
        &mut self,
        request_id: &str,
        params_json: Option<&str>,
        reason: &str,
        num_computed_tokens: usize,
        block_groups: GroupPairs,
    ) -> PyResult<(bool, Option<String>)> {
        let reason = match reason {
            "length" => FinishReason::LengthCapped,
            "stop" => FinishReason::Stopped,
            "abort" => FinishReason::Aborted,
            "error" => FinishReason::Error,
            other => return Err(PyValueError::new_err(format!("unknown finish reason {other:?}"))),
        };
        let p = params(request_id, params_json).unwrap_or_default();
        let out = self.inner.request_finished(
            &RequestId::new(request_id),
            p.as_ref(),
            reason,
            num_computed_tokens,
            &group_blocks(block_groups),
        );
        Ok((out.delay_free, out.params.map(|p| p.to_json())))
    }

    /// This step's metadata for the workers, encoded: loads to start, holds to keep, and (every
    /// sixth of a lease, decode side) the leases to renew.
    fn build_connector_meta<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let meta = self.inner.build_connector_meta(std::time::Instant::now());
        let bytes = wire::encode(&meta).map_err(py_err)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The workers' aggregated report: released holds, completed loads, failed loads (vLLM
    /// passes only their ids; the scheduler needs no more).
    fn update_finished(&mut self, sending: Vec<String>, recving: Vec<String>, failed_recving: Vec<String>) {
        let failed = |id| FailedRecv {
            request_id: RequestId::new(id),
            error: Error::new(ErrorKind::Transfer, "the load failed in a worker"),
        };
        let finished = Finished {
            sending: sending.into_iter().map(RequestId::new).collect(),
            recving: recving.into_iter().map(RequestId::new).collect(),
            failed_recving: failed_recving.into_iter().map(failed).collect(),
        };
        self.inner.update_finished(&finished);
    }

    /// Prefill side: requests whose blocks are held for a reader.
    #[getter]
    fn num_sending(&self) -> usize {
        self.inner.num_sending()
    }

    /// Decode side: requests whose loads are in flight.
    #[getter]
    fn num_recving(&self) -> usize {
        self.inner.num_recving()
    }

    /// Whether nothing is tracked.
    fn is_idle(&self) -> bool {
        self.inner.is_idle()
    }
}

/// Why decode engines on other hosts cannot reach a prefill engine whose workers advertise
/// `side_channel_host`, or `None`. An unspecified address (`0.0.0.0`, `::`) sends every decode
/// engine to its own machine; a loopback one does too, which is wrong when this node has another
/// address for the deployment (`node_host`: vLLM's `VLLM_HOST_IP`, set in multi-node deployments).
#[pyfunction]
#[pyo3(signature = (side_channel_host, node_host = None))]
pub fn side_channel_host_warning(side_channel_host: &str, node_host: Option<&str>) -> Option<String> {
    let advertised = HostScope::of(side_channel_host);
    let node = node_host.filter(|h| HostScope::of(h) == HostScope::Other);
    match (advertised, node) {
        (HostScope::Unspecified, _) => Some(format!(
            "side_channel_host {side_channel_host} is advertised to decode engines, which then connect \
             to their own machine: set side_channel_host to an address of this host they can reach"
        )),
        (HostScope::Loopback, Some(node)) => Some(format!(
            "side_channel_host {side_channel_host} is a loopback address, but this node is {node} \
             (VLLM_HOST_IP): decode engines on other hosts would connect to their own machine; set \
             side_channel_host to {node}"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

    use super::*;

    #[test]
    fn unspecified_side_channel_hosts_and_loopback_ones_on_a_networked_node_are_warned_about() {
        for host in ["0.0.0.0", "::"] {
            assert!(side_channel_host_warning(host, None).is_some_and(|w| w.contains(host)), "{host}");
        }
        let warning = side_channel_host_warning("127.0.0.1", Some("10.0.0.1"));
        assert!(warning.is_some_and(|w| w.contains("set side_channel_host to 10.0.0.1")));
        // One host (no node address, or a loopback one), or an address decode engines can use.
        for (host, node) in [
            ("127.0.0.1", None),
            ("localhost", Some("127.0.0.1")),
            ("10.0.0.1", Some("10.0.0.1")),
            ("prefill-0", None),
        ] {
            assert_eq!(side_channel_host_warning(host, node), None, "{host} {node:?}");
        }
    }

    /// The params a prefill scheduler hands out for a held request, with `discovery`.
    fn handed_out(discovery: Option<&str>) -> TransferParams {
        let mut s =
            Scheduler::new("prefill".into(), 4, "10.0.0.1".into(), 5600, None, 30.0, discovery, 1, vec![])
                .unwrap();
        let asked = r#"{"do_remote_decode": true}"#;
        let (delay_free, params) =
            s.request_finished("r", Some(asked), "length", 8, vec![(0, vec![3, 4])]).unwrap();
        assert!(delay_free);
        TransferParams::from_json(&params.unwrap()).unwrap()
    }

    #[test]
    fn with_etcd_discovery_the_params_name_the_engine_without_host_or_port() {
        let tcp = handed_out(None);
        assert_eq!((tcp.remote_host.as_deref(), tcp.remote_port), (Some("10.0.0.1"), Some(5600)));
        let by_id = handed_out(Some("etcd://127.0.0.1:2379"));
        assert_eq!((&by_id.remote_host, by_id.remote_port), (&None, None));
        assert_eq!(by_id.coordinates(), Some(kvx_core::RemoteCoordinates::by_id("prefill")));
        for bad in ["zmq://h:1", "etcd://h"] {
            let made = Scheduler::new("p".into(), 4, "h".into(), 1, None, 30.0, Some(bad), 1, vec![]);
            assert!(made.is_err(), "{bad}");
        }
    }

    #[test]
    fn vllm_block_lists_become_groups_past_their_leading_nulls() {
        // A 600-token prefill request of the tiny Gemma-3 (window 256, blocks of 128): the
        // sliding-window group dropped positions 0 and 1, the full-attention group has them all.
        let groups = vllm_block_groups(vec![vec![0, 0, 2, 1, 11], vec![12, 13, 14, 15, 16]], 0);
        assert_eq!(groups, vec![(2, vec![2, 1, 11]), (0, vec![12, 13, 14, 15, 16])]);
        // Decode side, 4 blocks hit locally: only the positions from 4 on; a sliding-window group
        // whose new blocks start past more nulls starts there.
        let groups =
            vllm_block_groups(vec![vec![0, 0, 0, 0, 0, 5, 20, 21], vec![6, 7, 8, 9, 22, 23, 24, 25]], 4);
        assert_eq!(groups, vec![(5, vec![5, 20, 21]), (4, vec![22, 23, 24, 25])]);
        // A null inside a run ends it; a start past the list is an empty group there.
        assert_eq!(vllm_block_groups(vec![vec![0, 3, 0, 4], vec![1]], 0), vec![(1, vec![3]), (0, vec![1])]);
        assert_eq!(vllm_block_groups(vec![vec![7], vec![]], 3), vec![(3, vec![]), (3, vec![])]);
        assert_eq!(vllm_block_groups(vec![vec![0, 0]], 0), vec![(2, vec![])]);
    }

    const BS: u32 = 128;

    fn hybrid(engine: &str, windows: Vec<Option<u32>>) -> Scheduler {
        Scheduler::new(engine.into(), BS, "127.0.0.1".into(), 5600, None, 30.0, None, 1, windows).unwrap()
    }

    #[test]
    fn a_hybrid_model_offers_and_loads_per_group_blocks() {
        let windows = vec![Some(256), None];
        // Prefill: 600 tokens computed, vLLM's lists after it dropped the out-of-window blocks.
        let mut prefill = hybrid("prefill", windows.clone());
        let blocks = vllm_block_groups(vec![vec![0, 0, 2, 1, 11], vec![12, 13, 14, 15, 16]], 0);
        let asked = r#"{"do_remote_decode": true}"#;
        let (delay_free, params) = prefill.request_finished("p", Some(asked), "length", 600, blocks).unwrap();
        assert!(delay_free);
        let params = params.unwrap();
        let offer = TransferParams::from_json(&params).unwrap();
        assert_eq!(offer.remote_block_ids, Some(vec![vec![2, 1], vec![12, 13, 14, 15]]), "full blocks only");
        assert_eq!(offer.kvx_group_first, vec![2, 0]);
        // Decode: the whole prompt's full blocks load, the sliding group's from position 2 on.
        let mut decode = hybrid("decode", windows);
        let p = TransferParams { do_remote_prefill: true, do_remote_decode: false, ..offer }.to_json();
        assert_eq!(decode.get_num_new_matched_tokens("d", 600, Some(&p), 0).unwrap(), (512, true));
        let alloc = vllm_block_groups(vec![vec![0, 0, 16, 11, 5], vec![10, 17, 18, 19, 20]], 0);
        assert!(decode.update_state_after_alloc("d", 600, Some(&p), alloc, 0, 512).unwrap());
        let meta = decode.inner.build_connector_meta(std::time::Instant::now());
        let r = &meta.reqs_to_recv[0];
        assert_eq!(
            r.local_block_ids,
            vec![GroupBlocks::new(2, vec![16, 11]), GroupBlocks::new(0, vec![10, 17, 18, 19])]
        );
        let (local, remote) = r.read_pairs().unwrap();
        assert_eq!((&local[..], &remote[..]), (&[16, 11, 10, 17, 18, 19][..], &[2, 1, 12, 13, 14, 15][..]));
        // An engine with one group loads nothing from a two-group offer, and does not raise.
        let single = hybrid("single", vec![]);
        assert_eq!(single.get_num_new_matched_tokens("s", 600, Some(&p), 0).unwrap(), (0, false));
    }

    #[test]
    fn a_prompt_one_token_short_of_a_block_is_computed_by_the_decode_engine() {
        // 383 tokens: the prefill engine's window (from token 128) no longer holds block 0,
        // which the window of the decode engine's first computed token (256) reaches.
        let windows = vec![Some(256), None];
        let mut prefill = hybrid("prefill", windows.clone());
        let blocks = vllm_block_groups(vec![vec![0, 2, 3], vec![4, 5, 6]], 0);
        let asked = r#"{"do_remote_decode": true}"#;
        let (delay_free, params) = prefill.request_finished("p", Some(asked), "length", 383, blocks).unwrap();
        assert!(delay_free, "held all the same: the decode engine tells it to free");
        let offer = TransferParams::from_json(&params.unwrap()).unwrap();
        assert_eq!(
            (offer.remote_block_ids.clone(), offer.kvx_group_first.clone()),
            (Some(vec![vec![2], vec![4, 5]]), vec![1, 0])
        );
        let mut decode = hybrid("decode", windows);
        let p = TransferParams { do_remote_prefill: true, do_remote_decode: false, ..offer }.to_json();
        assert_eq!(decode.get_num_new_matched_tokens("d", 383, Some(&p), 0).unwrap(), (0, false));
        assert!(decode.update_state_after_alloc("d", 383, Some(&p), vec![], 0, 0).unwrap());
        let meta = decode.inner.build_connector_meta(std::time::Instant::now());
        assert!(meta.reqs_to_recv[0].is_notify_only());
    }

    #[test]
    fn a_window_of_no_tokens_is_refused() {
        let made = Scheduler::new("e".into(), BS, "h".into(), 1, None, 30.0, None, 1, vec![None, Some(0)]);
        assert!(made.is_err());
    }
}

//! `kv_connector_extra_config["discovery"]`: how the engines find each other's handshake payloads.

use pyo3::PyResult;
use pyo3::exceptions::PyValueError;

use kvx_etcd::EtcdUrl;

/// The etcd cluster `discovery` names, or `None` for each worker's TCP side channel: absent,
/// empty or `"tcp"`. Anything else but `etcd://HOST:PORT[,HOST:PORT]` is a `ValueError`.
pub(crate) fn etcd_url(discovery: Option<&str>) -> PyResult<Option<EtcdUrl>> {
    match discovery {
        None | Some("" | "tcp") => Ok(None),
        Some(url) if url.starts_with(kvx_etcd::SCHEME) => {
            EtcdUrl::parse(url).map(Some).map_err(crate::py_err)
        }
        Some(other) => Err(PyValueError::new_err(format!(
            "kv_connector_extra_config discovery {other:?}: expected \"tcp\" or \"etcd://HOST:PORT[,HOST:PORT]\""
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_is_absent_tcp_or_an_etcd_url() {
        for tcp in [None, Some(""), Some("tcp")] {
            assert_eq!(etcd_url(tcp).unwrap(), None, "{tcp:?}");
        }
        let url = etcd_url(Some("etcd://10.0.0.5:2379,10.0.0.6:2379")).unwrap().unwrap();
        assert_eq!(url.to_string(), "etcd://10.0.0.5:2379,10.0.0.6:2379");
        for bad in ["etcd://", "etcd://h", "etcd://h:1/x", "zmq://h:1", "TCP", "h:2379"] {
            assert!(etcd_url(Some(bad)).is_err(), "{bad}");
        }
    }
}

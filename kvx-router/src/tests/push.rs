//! `--mode push`: once a prefill server's answer said where it is, both legs of a request go out
//! together; until then, and after it failed, in order.

use super::*;

async fn push_router(prefill: &[&str], decode: &[&str]) -> (Arc<Shared>, String) {
    router_in(Mode::Push, prefill, decode, Limits::default(), 1 << 20).await
}

/// The prefill leg's params in push mode.
fn push_prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null, "transfer_mode": "push"})
}

#[tokio::test]
async fn both_legs_go_out_together_once_the_prefill_server_answered_once() {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (_router, url) = push_router(&[&p.url], &[&d.url]).await;
    let request = json!({"model": "m", "prompt": "hello", "max_tokens": 7});
    // The first request goes in order: nothing says yet where p0's connector is.
    assert_eq!(complete(&url, request.clone()).await.status(), 200);
    assert_eq!(p.next_arrival().await.body["kv_transfer_params"], push_prefill_params());
    assert_eq!(d.next_arrival().await.body["kv_transfer_params"], p.params(), "the answer's params");

    // Now the decode leg goes out while the prefill leg is still held at p0.
    p.gate.forget_permits(Semaphore::MAX_PERMITS);
    let response = tokio::spawn({
        let url = url.clone();
        async move { complete(&url, request).await }
    });
    let prefilled = p.next_arrival().await;
    let decoded = d.next_arrival().await;
    assert_eq!(prefilled.body["kv_transfer_params"], push_prefill_params());
    assert_eq!(
        decoded.body["kv_transfer_params"],
        json!({"do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "push",
               "remote_engine_id": "p0", "remote_host": "127.0.0.1", "remote_port": 5600}),
        "p0's whereabouts, no blocks"
    );
    assert!(prefilled.request_id.is_some());
    assert_eq!(prefilled.request_id, decoded.request_id, "one X-Request-Id pairs the legs");
    p.gate.add_permits(1);
    let response = within("the pushed request's answer", response).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(json_of(response).await["choices"][0]["text"], "decoded by d0");
    let text = metrics(&url).await;
    assert_eq!(metric(&text, "kvx_router_dispatched_together_total"), 1.0);
    assert_eq!(metric(&text, r#"kvx_router_requests_total{route="completions",outcome="ok"}"#), 2.0);
}

/// A push-mode router in front of one prefill and one decode stub, after one request in order
/// (p0's answer said where it is); the request body to send again.
async fn answered_once() -> (Arc<Stub>, Arc<Stub>, Arc<Shared>, String, Value) {
    let (p, d) = (stub("p0", Role::Prefill).await, stub("d0", Role::Decode).await);
    let (router, url) = push_router(&[&p.url], &[&d.url]).await;
    let request = json!({"model": "m", "prompt": "hello", "max_tokens": 7});
    assert_eq!(complete(&url, request.clone()).await.status(), 200);
    p.next_arrival().await;
    d.next_arrival().await;
    (p, d, router, url, request)
}

#[tokio::test]
async fn a_prefill_leg_that_fails_while_its_decode_leg_waits_drops_the_decode_leg() {
    let (p, d, router, url, request) = answered_once().await;
    // p0 fails its next request and its health check: the decode leg, held at d0, is dropped,
    // and with no other prefill server the client gets a 503, not a decode answer.
    d.gate.forget_permits(Semaphore::MAX_PERMITS);
    p.gate.forget_permits(Semaphore::MAX_PERMITS);
    p.status.store(500, Ordering::SeqCst);
    p.health.store(503, Ordering::SeqCst);
    let response = tokio::spawn({
        let (url, request) = (url.clone(), request.clone());
        async move { complete(&url, request).await }
    });
    p.next_arrival().await;
    assert_eq!(d.next_arrival().await.body["kv_transfer_params"]["transfer_mode"], "push");
    p.gate.add_permits(1);
    let response = within("the answer", response).await.unwrap();
    assert_eq!(response.status(), 503, "{:?}", response.text().await);
    // Back in rotation, p0 is asked in order again (its failure forgot where it was).
    p.status.store(200, Ordering::SeqCst);
    p.health.store(200, Ordering::SeqCst);
    router.check_health().await;
    p.gate.add_permits(Semaphore::MAX_PERMITS);
    d.gate.add_permits(Semaphore::MAX_PERMITS);
    assert_eq!(complete(&url, request).await.status(), 200);
    p.next_arrival().await;
    assert_eq!(d.next_arrival().await.body["kv_transfer_params"], p.params());
    assert_eq!(metric(&metrics(&url).await, "kvx_router_dispatched_together_total"), 1.0);
}

#[tokio::test]
async fn a_prefill_server_found_down_by_its_health_check_is_asked_in_order_when_it_is_back() {
    let (p, d, router, url, request) = answered_once().await;
    // Restarted meanwhile (down at one health check, up at the next): maybe another engine now.
    p.health.store(503, Ordering::SeqCst);
    router.check_health().await;
    p.health.store(200, Ordering::SeqCst);
    router.check_health().await;
    assert_eq!(complete(&url, request).await.status(), 200);
    p.next_arrival().await;
    assert_eq!(
        d.next_arrival().await.body["kv_transfer_params"],
        p.params(),
        "in order: the answer's params"
    );
    assert_eq!(metric(&metrics(&url).await, "kvx_router_dispatched_together_total"), 0.0);
}

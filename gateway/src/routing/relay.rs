//! Streamed answers that survive the node serving them.
//!
//! The gateway relays a node's server-sent events to the client one complete event at a
//! time and keeps what it has sent: whether `message_start`, each content block's start and
//! stop, `message_delta` and `message_stop` went out, and each block's text. If the node
//! fails before `message_stop`, the request goes to the next node under the same request id.
//! Generation is reproducible per request id (greedy, or sampling seeded by the request id;
//! cached and recomputed prefixes give identical output), so the new node's stream replays
//! what the client already has: [`Splice`] drops what was sent, checks that the replayed text
//! matches it byte for byte, and passes on the rest, cutting a text delta that straddles the
//! point where the first node stopped. The client sees one uninterrupted stream.
//!
//! What cannot be spliced ends the stream with an `error` event, as Anthropic's API does
//! mid-stream: a replay that differs from what was sent, or a block of non-text deltas
//! (tool input) that was partly sent.

use std::collections::BTreeMap;

use bytes::Bytes;

/// What to do with one event of the node's stream.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Send these bytes to the client.
    Emit(Bytes),
    /// Already sent (a replay): drop it.
    Skip,
    /// Send these bytes; the stream is complete (`message_stop`, or an `error` event).
    End(Bytes),
    /// The replay differs from what the client has: the stream cannot go on.
    Diverged(String),
}

#[derive(Default, Debug)]
struct SentBlock {
    started: bool,
    stopped: bool,
    text: String,
    /// Non-text deltas (tool input, thinking) went out: the block cannot be replayed.
    opaque: bool,
}

/// What the client has been sent, and how far the current node's replay of it has got.
#[derive(Default, Debug)]
pub(crate) struct Splice {
    message_start: bool,
    message_delta: bool,
    message_stop: bool,
    blocks: BTreeMap<u64, SentBlock>,
    /// Text bytes of each block the current node has produced.
    replayed: BTreeMap<u64, usize>,
    resumed: bool,
}

/// An SSE `error` event in the Messages API's shape.
pub(crate) fn error_event(kind: &str, message: &str) -> Bytes {
    let data = serde_json::json!({
        "type": "error",
        "error": {"type": kind, "message": message},
    });
    Bytes::from(format!("event: error\ndata: {data}\n\n"))
}

/// The comment a resumed stream carries where another node took over: `: cachet-node <id>`.
/// Comments are part of SSE (lines starting with `:`), so SDKs skip it.
pub(crate) fn resumed_note(node: &str) -> Bytes {
    let id: String = node.chars().filter(|c| !c.is_control()).collect();
    Bytes::from(format!(": {RESUMED_NOTE}{id}\n\n"))
}

/// What a resumed stream's comment starts with (after `: `), before the node's id.
pub const RESUMED_NOTE: &str = "cachet-node ";

/// The end of the first complete event in `buf` (just past its blank line), if any.
pub(crate) fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl Splice {
    /// Whether the client has the whole answer.
    pub(crate) fn complete(&self) -> bool {
        self.message_stop
    }

    /// Another node takes over: its stream starts from the beginning.
    pub(crate) fn restart(&mut self) {
        self.replayed.clear();
        self.resumed = true;
    }

    /// Decide about one complete event (its bytes, blank line included).
    pub(crate) fn event(&mut self, raw: Bytes) -> Step {
        let Ok(text) = std::str::from_utf8(&raw) else {
            return Step::Diverged("an event is not UTF-8".into());
        };
        let data: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect::<Vec<_>>()
            .join("\n");
        if data == "[DONE]" {
            // The end of a Chat Completions stream (relayed, never resumed).
            self.message_stop = true;
            return Step::End(raw);
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else {
            // Comments and keep-alives carry no JSON; they change nothing.
            return Step::Emit(raw);
        };
        let index = v["index"].as_u64().unwrap_or(0);
        match v["type"].as_str().unwrap_or("") {
            "message_start" => once(&mut self.message_start, raw),
            "content_block_start" => once(&mut self.blocks.entry(index).or_default().started, raw),
            "content_block_delta" => self.delta(index, &v, raw),
            "content_block_stop" => {
                let seen = self.replayed.get(&index).copied().unwrap_or(0);
                let block = self.blocks.entry(index).or_default();
                if block.stopped {
                    return Step::Skip;
                }
                if !block.opaque && seen < block.text.len() {
                    return Step::Diverged(format!(
                        "block {index} ended after {seen} of the {} text bytes already sent",
                        block.text.len()
                    ));
                }
                block.stopped = true;
                Step::Emit(raw)
            }
            "message_delta" => once(&mut self.message_delta, raw),
            "message_stop" => {
                self.message_stop = true;
                Step::End(raw)
            }
            "error" => Step::End(raw),
            _ => Step::Emit(raw),
        }
    }

    fn delta(&mut self, index: u64, v: &serde_json::Value, raw: Bytes) -> Step {
        let block = self.blocks.entry(index).or_default();
        let seen = self.replayed.entry(index).or_insert(0);
        if block.stopped {
            return Step::Skip;
        }
        let Some(t) = v["delta"]["text"]
            .as_str()
            .filter(|_| v["delta"]["type"] == "text_delta")
        else {
            if self.resumed && (block.opaque || !block.text.is_empty()) {
                return Step::Diverged(format!(
                    "block {index} had non-text deltas sent; it cannot be replayed"
                ));
            }
            block.opaque = true;
            return Step::Emit(raw);
        };
        if block.opaque {
            return Step::Diverged(format!("block {index} mixes text and other deltas"));
        }
        let sent = block.text.len();
        if *seen >= sent {
            *seen += t.len();
            block.text.push_str(t);
            return Step::Emit(raw);
        }
        let overlap = (sent - *seen).min(t.len());
        if block.text.as_bytes()[*seen..*seen + overlap] != t.as_bytes()[..overlap]
            || !t.is_char_boundary(overlap)
        {
            return Step::Diverged(format!(
                "block {index}'s replayed text differs from what was sent at byte {seen}"
            ));
        }
        *seen += t.len();
        if overlap == t.len() {
            return Step::Skip;
        }
        let rest = &t[overlap..];
        block.text.push_str(rest);
        let mut cut = v.clone();
        cut["delta"]["text"] = rest.into();
        Step::Emit(Bytes::from(format!(
            "event: content_block_delta\ndata: {cut}\n\n"
        )))
    }
}

/// Emit the first time, skip replays.
fn once(sent: &mut bool, raw: Bytes) -> Step {
    if *sent {
        Step::Skip
    } else {
        *sent = true;
        Step::Emit(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: &str, data: serde_json::Value) -> Bytes {
        Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
    }

    fn text(index: u64, t: &str) -> Bytes {
        ev(
            "content_block_delta",
            serde_json::json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "text_delta", "text": t}}),
        )
    }

    fn start() -> Vec<Bytes> {
        vec![
            ev(
                "message_start",
                serde_json::json!({"type": "message_start", "message": {"id": "msg_1"}}),
            ),
            ev(
                "content_block_start",
                serde_json::json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
            ),
        ]
    }

    fn end() -> Vec<Bytes> {
        vec![
            ev(
                "content_block_stop",
                serde_json::json!({"type": "content_block_stop", "index": 0}),
            ),
            ev(
                "message_delta",
                serde_json::json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
            ),
            ev("message_stop", serde_json::json!({"type": "message_stop"})),
        ]
    }

    #[test]
    fn a_chat_completions_stream_ends_at_done() {
        let mut s = Splice::default();
        let chunk =
            Bytes::from_static(b"data: {\"object\":\"chat.completion.chunk\",\"choices\":[]}\n\n");
        assert!(matches!(s.event(chunk), Step::Emit(_)));
        assert!(!s.complete());
        assert!(matches!(
            s.event(Bytes::from_static(b"data: [DONE]\n\n")),
            Step::End(_)
        ));
        assert!(s.complete());
    }

    /// The text the client ends up with.
    fn client_text(out: &[Bytes]) -> String {
        out.iter()
            .filter_map(|b| {
                let s = std::str::from_utf8(b).unwrap();
                let data = s.lines().find_map(|l| l.strip_prefix("data: "))?;
                let v: serde_json::Value = serde_json::from_str(data).ok()?;
                v["delta"]["text"].as_str().map(str::to_string)
            })
            .collect()
    }

    fn run(s: &mut Splice, events: Vec<Bytes>, out: &mut Vec<Bytes>) -> Option<String> {
        for e in events {
            match s.event(e) {
                Step::Emit(b) | Step::End(b) => out.push(b),
                Step::Skip => {}
                Step::Diverged(why) => return Some(why),
            }
        }
        None
    }

    #[test]
    fn a_replay_is_spliced_where_the_first_node_stopped() {
        let mut s = Splice::default();
        let mut out = Vec::new();
        // The first node sends "Hello, wor" and dies.
        let mut first = start();
        first.extend([text(0, "Hello"), text(0, ", wor")]);
        assert_eq!(run(&mut s, first, &mut out), None);
        assert!(!s.complete());
        // The second replays in other chunks: "Hel", "lo, world", "!"; then ends.
        s.restart();
        let mut second = start();
        second.extend([text(0, "Hel"), text(0, "lo, world"), text(0, "!")]);
        second.extend(end());
        assert_eq!(run(&mut s, second, &mut out), None);
        assert!(s.complete());
        assert_eq!(client_text(&out), "Hello, world!");
        let kinds: Vec<&str> = out
            .iter()
            .map(|b| std::str::from_utf8(b).unwrap().lines().next().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "event: message_start",
                "event: content_block_start",
                "event: content_block_delta",
                "event: content_block_delta",
                "event: content_block_delta",
                "event: content_block_delta",
                "event: content_block_stop",
                "event: message_delta",
                "event: message_stop",
            ],
            "each event once, in order"
        );
    }

    #[test]
    fn a_different_replay_or_a_partly_sent_tool_block_cannot_be_spliced() {
        let mut s = Splice::default();
        let mut out = Vec::new();
        let mut first = start();
        first.push(text(0, "Paris is"));
        run(&mut s, first, &mut out);
        s.restart();
        let mut second = start();
        second.push(text(0, "Lyon is"));
        assert!(run(&mut s, second, &mut out).is_some());

        // A replay whose block ends before what was sent.
        let mut s = Splice::default();
        let mut first = start();
        first.push(text(0, "abc"));
        run(&mut s, first, &mut Vec::new());
        s.restart();
        let mut second = start();
        second.push(text(0, "ab"));
        second.extend(end());
        assert!(run(&mut s, second, &mut Vec::new()).is_some());

        // Tool input deltas partly sent.
        let json = |p: &str| {
            ev(
                "content_block_delta",
                serde_json::json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "input_json_delta", "partial_json": p}}),
            )
        };
        let mut s = Splice::default();
        let mut first = start();
        first.push(json("{\"a\""));
        assert_eq!(run(&mut s, first, &mut Vec::new()), None);
        s.restart();
        let mut second = start();
        second.push(json("{\"a\""));
        assert!(run(&mut s, second, &mut Vec::new()).is_some());
    }

    #[test]
    fn a_replay_chunked_differently_around_a_multibyte_character_splices_cleanly() {
        let mut s = Splice::default();
        let mut first = start();
        first.push(text(0, "caf"));
        run(&mut s, first, &mut Vec::new());
        s.restart();
        let mut out = Vec::new();
        let mut second = start();
        second.push(text(0, "café"));
        second.extend(end());
        assert_eq!(run(&mut s, second, &mut out), None);
        assert_eq!(client_text(&out), "é");
    }

    /// Split `answer` into deltas at the given cut points (char boundaries).
    fn chunks(answer: &str, cuts: &[usize]) -> Vec<Bytes> {
        let mut points: Vec<usize> = cuts
            .iter()
            .map(|c| c % (answer.len() + 1))
            .filter(|c| answer.is_char_boundary(*c))
            .collect();
        points.extend([0, answer.len()]);
        points.sort_unstable();
        points.dedup();
        points
            .windows(2)
            .map(|w| text(0, &answer[w[0]..w[1]]))
            .collect()
    }

    proptest::proptest! {
        /// However the two nodes chunk the same answer, and wherever the first one dies,
        /// the client receives the answer exactly once, each event kind once.
        #[test]
        fn any_chunking_and_any_failure_point_splice_to_the_whole_answer(
            text in "[a-zé😀 ,.]{0,60}",
            first_cuts in proptest::collection::vec(0usize..80, 0..12),
            second_cuts in proptest::collection::vec(0usize..80, 0..12),
            died_after in 0usize..16,
        ) {
            let mut all_first = start();
            all_first.extend(chunks(&text, &first_cuts));
            all_first.extend(end());
            let mut s = Splice::default();
            let mut out = Vec::new();
            let cut = died_after.min(all_first.len() - 1);
            proptest::prop_assert_eq!(run(&mut s, all_first[..cut].to_vec(), &mut out), None);
            s.restart();
            let mut second = start();
            second.extend(chunks(&text, &second_cuts));
            second.extend(end());
            proptest::prop_assert_eq!(run(&mut s, second, &mut out), None);
            proptest::prop_assert!(s.complete());
            proptest::prop_assert_eq!(client_text(&out), text);
            let count = |k: &str| out.iter().filter(|b| std::str::from_utf8(b).unwrap().starts_with(&format!("event: {k}\n"))).count();
            for k in ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"] {
                proptest::prop_assert_eq!(count(k), 1, "{}", k);
            }
        }
    }

    #[test]
    fn events_end_at_a_blank_line() {
        assert_eq!(event_end(b"event: a\ndata: {}\n\nevent: b"), Some(19));
        assert_eq!(event_end(b"event: a\r\ndata: {}\r\n\r\n"), Some(22));
        assert_eq!(event_end(b"event: a\ndata: {}\n"), None);
        let e = error_event("overloaded_error", "x");
        assert!(
            std::str::from_utf8(&e)
                .unwrap()
                .starts_with("event: error\ndata: {")
        );
        assert_eq!(event_end(&e), Some(e.len()));
    }
}

//! The meter's spool and open-stream journal as read back after a crash: any bytes. Every
//! line is either an event or counted unreadable, and one bad line never costs another.

#![no_main]

use billing::meter::parse_event_lines;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let read = parse_event_lines(data);
    assert_eq!(read.events.len() + read.unreadable.len(), read.lines);
    // Appending a good line after the bytes (with the newline a reopened spool adds) adds
    // exactly one event.
    if let Some(first) = read.events.first() {
        let mut more = data.to_vec();
        if more.last().is_some_and(|b| *b != b'\n') {
            more.push(b'\n');
        }
        more.extend_from_slice(&billing_line(first));
        let again = parse_event_lines(&more);
        assert_eq!(again.events.len(), read.events.len() + 1);
    }
});

/// The spool's own encoding of an event: one JSON object and a newline.
fn billing_line(e: &billing::UsageEvent) -> Vec<u8> {
    let mut v = serde_json::to_vec(e).unwrap();
    v.push(b'\n');
    v
}

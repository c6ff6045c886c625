"""PII: e-mail and public IP addresses replaced and counted; look-alikes left alone."""

from __future__ import annotations

import pytest

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.pii import PIIConfig, PIIRedact

STAGE = PIIRedact(PIIConfig())


def redact(text: str, stage: PIIRedact = STAGE) -> tuple[str, dict]:
    doc = Document("d", text, "s", {"file": "f"})
    assert stage.apply(doc) is None  # PII never removes a document
    return doc.text, doc.meta["pii"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Mail john.doe@example.com today.", "Mail <EMAIL> today."),
        ("jane_smith+news@mail.co.uk, bob@sub.example.org", "<EMAIL>, <EMAIL>"),
        ("(x-y.z@foo-bar.io)", "(<EMAIL>)"),
        ("Write to Ünal@example.de.", "Write to <EMAIL>."),
    ],
)
def test_emails_are_replaced(text: str, expected: str) -> None:
    out, counts = redact(text)
    assert out == expected
    assert counts == {"email": expected.count("<EMAIL>"), "ip": 0}


@pytest.mark.parametrize(
    "text",
    [
        "a@b",
        "user@localhost",
        "follow @handle on social media",
        "npm install pkg@1.2.3",
        "john@example",
        "price: 3 @ $4.50",
        "email@123.456",
    ],
)
def test_email_look_alikes_are_kept(text: str) -> None:
    assert redact(text) == (text, {"email": 0, "ip": 0})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Resolver 8.8.8.8 answered.", "Resolver <IP> answered."),
        ("from 203.0.113.7? no: from 151.101.1.69.", "from 203.0.113.7? no: from <IP>."),
        ("host=1.1.1.1:53", "host=<IP>:53"),
        ("v6 at 2606:4700:4700::1111 now", "v6 at <IP> now"),
        ("full 2a00:1450:4001:0829:0000:0000:0000:200e.", "full <IP>."),
    ],
)
def test_public_ips_are_replaced(text: str, expected: str) -> None:
    out, counts = redact(text)
    assert out == expected
    assert counts == {"email": 0, "ip": expected.count("<IP>")}


@pytest.mark.parametrize(
    "text",
    [
        "version 1.2.3 released",
        "Chrome 96.0.4664.110 on 1.2.3.4.5",
        "256.1.1.1 is not an address",
        "01.02.03.04 has leading zeros",
        "dated 2023.01.15, pi is 3.14159",
        "router 192.168.1.1, localhost 127.0.0.1, lan 10.0.0.2",
        "docs use 2001:db8::1 and ::1 and fe80::1",
        "meeting at 12:30:45, std::vector<int>, a::b::c",
        "section 1.2.3.4a",
    ],
)
def test_ip_look_alikes_and_private_addresses_are_kept(text: str) -> None:
    assert redact(text) == (text, {"email": 0, "ip": 0})


def test_private_ips_redacted_when_asked_and_switches_work() -> None:
    everything = PIIRedact(PIIConfig(public_ips_only=False, ip_placeholder="[ip]"))
    assert redact("router 192.168.1.1 and ::1", everything) == (
        "router [ip] and [ip]",
        {"email": 0, "ip": 2},
    )
    no_email = PIIRedact(PIIConfig(email=False))
    assert redact("a.b@example.com 8.8.4.4", no_email)[0] == "a.b@example.com <IP>"
    no_ip = PIIRedact(PIIConfig(ip=False))
    assert redact("a.b@example.com 8.8.4.4", no_ip)[0] == "<EMAIL> 8.8.4.4"


def test_long_tokens_do_not_blow_up() -> None:
    # Bounded quantifiers: a 200k-character token with an @ costs linear time.
    text = "x" * 100_000 + "@" + "y." * 50_000
    out, counts = redact(text)
    assert counts["email"] == 0 and out == text


def test_stage_pickles() -> None:
    import pickle

    again = pickle.loads(pickle.dumps(STAGE))
    assert redact("x 8.8.8.8 a.b@example.com", again) == redact("x 8.8.8.8 a.b@example.com")


PHONES = PIIRedact(PIIConfig(phone=True, phone_placeholder="[tel]"))


@pytest.mark.parametrize(
    "number",
    [
        "+44 20 7946 0958",
        "+1 (555) 123-4567",
        "+33 1 23 45 67 89",
        "+49 30 12345678",
        "+8613812345678",
        "(555) 123-4567",
        "555-123-4567",
        "555.123.4567",
        "020 7946 0958",
        "030 1234 5678",
        "01 23 45 67 89",
        "07700 900123",
        "0171-1234567",
    ],
)
def test_phone_numbers_are_replaced_with_the_configured_token(number: str) -> None:
    out, counts = redact(f"Call {number}. Or mail a@example.com", PHONES)
    assert out == "Call [tel]. Or mail <EMAIL>"
    assert counts == {"email": 1, "ip": 0, "phone": 1}


@pytest.mark.parametrize(
    "text",
    [
        "05-12-2020",
        "2020-01-15",
        "1990-2000",
        "ISBN 978-3-16-148410-0",
        "version 1.2.3 and v10.0.19041",
        "$1,234,567",
        "call 911",
        "12:30:45",
        "123-45-6789",
        "id 1234567890123",
        "pi is 3.14159265358979",
        "+5 points",
    ],
)
def test_phone_look_alikes_are_left_alone(text: str) -> None:
    assert redact(text, PHONES) == (text, {"email": 0, "ip": 0, "phone": 0})


def test_phones_are_off_by_default_and_counts_keep_their_shape() -> None:
    assert redact("Call 555-123-4567.") == ("Call 555-123-4567.", {"email": 0, "ip": 0})

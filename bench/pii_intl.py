"""International PII sentences with recorded spans, for bench/quality.py's `pii-intl` part.

The values come from public generators on PyPI, never from our detectors' rules:
- Faker (MIT, bench/requirements-quality.txt) with each locale's own providers: names, phone
  numbers, e-mail addresses, street addresses, postcodes, cities, IBANs.
- `phonenumbers` (Apache-2.0; libphonenumber's metadata): half of the phone numbers are its
  example numbers per region (`example_number_for_type`, fixed line and mobile) with their
  subscriber digits redrawn until `is_valid_number` holds, written in the NATIONAL,
  INTERNATIONAL or E164 layout: the formats people write in each country.
The sentences: half are presidio-evaluator 0.3.2's templates (MIT; CC BY-SA 3.0 US) whose
placeholders are all kinds drawn here (English text with the locale's values, as a
multinational's support tickets are), half are frames of our own in the locale's language
(`FRAMES`, natural sentences written for this bench, not from any detector's patterns).

Gold kinds as presidio-evaluator names them: PERSON, PHONE_NUMBER, EMAIL_ADDRESS,
STREET_ADDRESS, ZIP_CODE, GPE (a city), IBAN_CODE. Seeded: the same texts on every run.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

Span = tuple[int, int, str]

LOCALES = ("de_DE", "fr_FR", "it_IT", "es_ES", "nl_NL", "en_GB", "en_IN", "pt_BR")

# Natural sentences per language, written for this bench: a name, a phone, an e-mail, an
# address with its city, a postcode and a city, an IBAN, as people write them in messages.
_DE = (
    "Bitte rufen Sie {name} unter {phone} zurück.",
    "Meine neue Adresse lautet {address}.",
    "Sie erreichen mich tagsüber unter {phone} oder per Mail an {email}.",
    "Die Rechnung geht an {name}, {address}.",
    "Überweisen Sie den Betrag bitte auf das Konto {iban}.",
    "Ich wohne seit März in {postcode} {city}.",
    "Hallo {first_name}, kannst du mir deine Handynummer schicken? Meine ist {phone}.",
    "Der Vertrag wurde von {name} unterschrieben.",
    "Lieferanschrift: {address}",
    "Herr {last_name} hat gestern angerufen, Rückrufnummer {phone}.",
)
_FR = (
    "Merci de rappeler {name} au {phone}.",
    "Ma nouvelle adresse est {address}.",
    "Vous pouvez me joindre au {phone} ou par e-mail à {email}.",
    "La facture est à envoyer à {name}, {address}.",
    "Veuillez virer le montant sur le compte {iban}.",
    "J'habite à {postcode} {city} depuis l'an dernier.",
    "Salut {first_name}, tu peux m'envoyer ton numéro ? Le mien, c'est le {phone}.",
    "Le contrat a été signé par {name}.",
    "Adresse de livraison : {address}",
    "Madame {last_name} a appelé hier, son numéro est le {phone}.",
)
_IT = (
    "Per favore richiami {name} al numero {phone}.",
    "Il mio nuovo indirizzo è {address}.",
    "Mi trovate al {phone} oppure via e-mail a {email}.",
    "La fattura va intestata a {name}, {address}.",
    "Effettuare il bonifico sul conto {iban}.",
    "Abito a {postcode} {city} da due anni.",
    "Ciao {first_name}, mi mandi il tuo numero? Il mio è {phone}.",
    "Il contratto è stato firmato da {name}.",
    "Indirizzo di consegna: {address}",
    "Il signor {last_name} ha chiamato ieri, numero {phone}.",
)
_ES = (
    "Por favor, llame a {name} al {phone}.",
    "Mi nueva dirección es {address}.",
    "Puede contactarme en el {phone} o por correo en {email}.",
    "La factura debe ir a nombre de {name}, {address}.",
    "Realice la transferencia a la cuenta {iban}.",
    "Vivo en {postcode} {city} desde hace un año.",
    "Hola {first_name}, ¿me pasas tu número? El mío es {phone}.",
    "El contrato lo firmó {name}.",
    "Dirección de entrega: {address}",
    "La señora {last_name} llamó ayer, su teléfono es {phone}.",
)
_NL = (
    "Wilt u {name} terugbellen op {phone}?",
    "Mijn nieuwe adres is {address}.",
    "U kunt mij bereiken op {phone} of via {email}.",
    "De factuur gaat naar {name}, {address}.",
    "Maak het bedrag over naar rekening {iban}.",
    "Ik woon sinds vorig jaar in {postcode} {city}.",
    "Hoi {first_name}, stuur je me je nummer? Het mijne is {phone}.",
    "Het contract is ondertekend door {name}.",
    "Afleveradres: {address}",
    "Meneer {last_name} belde gisteren, terugbelnummer {phone}.",
)
_EN = (
    "Please call {name} back on {phone}.",
    "My new address is {address}.",
    "You can reach me on {phone} or by email at {email}.",
    "The invoice goes to {name}, {address}.",
    "Please transfer the amount to account {iban}.",
    "I have lived in {city} {postcode} since last year.",
    "Hi {first_name}, could you send me your number? Mine is {phone}.",
    "The contract was signed by {name}.",
    "Delivery address: {address}",
    "Mr {last_name} rang yesterday, call back on {phone}.",
)
_PT = (
    "Por favor, ligue para {name} no {phone}.",
    "Meu novo endereço é {address}.",
    "Você pode me ligar no {phone} ou mandar um e-mail para {email}.",
    "A fatura vai para {name}, {address}.",
    "Faça a transferência para a conta {iban}.",
    "Moro em {city}, CEP {postcode}, desde o ano passado.",
    "Oi {first_name}, me passa o seu número? O meu é {phone}.",
    "O contrato foi assinado por {name}.",
    "Endereço de entrega: {address}",
    "A senhora {last_name} ligou ontem, o número é {phone}.",
)
FRAMES = {
    "de_DE": _DE,
    "fr_FR": _FR,
    "it_IT": _IT,
    "es_ES": _ES,
    "nl_NL": _NL,
    "en_GB": _EN,
    "en_IN": _EN,
    "pt_BR": _PT,
}
_KIND = {
    "name": "PERSON",
    "first_name": "PERSON",
    "last_name": "PERSON",
    "phone": "PHONE_NUMBER",
    "email": "EMAIL_ADDRESS",
    "address": "STREET_ADDRESS",
    "postcode": "ZIP_CODE",
    "city": "GPE",
    "iban": "IBAN_CODE",
}
# presidio-evaluator's placeholders -> ours (its templates that use only these are drawn)
_TEMPLATE_SLOTS = {
    "name": "name",
    "person": "name",
    "name_female": "name",
    "name_male": "name",
    "first_name": "first_name",
    "first_name_male": "first_name",
    "first_name_female": "first_name",
    "last_name": "last_name",
    "last_name_male": "last_name",
    "last_name_female": "last_name",
    "phone_number": "phone",
    "email": "email",
    "address": "address",
    "city": "city",
    "postcode": "postcode",
    "zipcode": "postcode",
    "iban": "iban",
}


@dataclass
class IntlText:
    text: str
    spans: list[Span]
    locale: str
    source: str  # "frame" or "template"


def _templates() -> list[str]:
    """presidio-evaluator's templates whose placeholders are all drawn here, in our syntax."""
    import importlib.resources

    path = importlib.resources.files("presidio_evaluator.data_generator") / "raw_data"
    out = []
    for line in (path / "templates.txt").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        slots = re.findall(r"\{\{(\w+)\}\}", line)
        if line and slots and all(s in _TEMPLATE_SLOTS for s in slots):
            out.append(re.sub(r"\{\{(\w+)\}\}", lambda m: "{" + _TEMPLATE_SLOTS[m[1]] + "}", line))
    return out


def _example_phone(region: str, rng: random.Random) -> str:
    """A valid number of `region` (libphonenumber's example for a fixed line or a mobile, its
    last digits redrawn until the number is valid), in a layout people write."""
    import phonenumbers as pn

    kind = rng.choice((pn.PhoneNumberType.FIXED_LINE, pn.PhoneNumberType.MOBILE))
    example = pn.example_number_for_type(region, kind)
    national = str(example.national_number)
    number = example
    for _ in range(20):
        keep = max(2, len(national) - 5)
        digits = national[:keep] + "".join(rng.choice("0123456789") for _ in national[keep:])
        candidate = pn.parse("+" + str(example.country_code) + digits)
        if pn.is_valid_number(candidate):
            number = candidate
            break
    f = pn.PhoneNumberFormat
    layout = rng.choice((f.NATIONAL, f.NATIONAL, f.INTERNATIONAL, f.E164))
    return pn.format_number(number, layout)


def _value(slot: str, fake: object, region: str, rng: random.Random) -> str:
    f: object = fake
    if slot == "phone":
        return _example_phone(region, rng) if rng.random() < 0.5 else f.phone_number()  # type: ignore[attr-defined]
    if slot == "address":  # its lines joined as written in one line
        return ", ".join(p.strip() for p in f.address().splitlines() if p.strip())  # type: ignore[attr-defined]
    if slot == "name":
        return f.name()  # type: ignore[attr-defined]
    return str(getattr(f, slot)())


def intl_data(per_locale: int, seed: int = 11) -> list[IntlText]:
    """`per_locale` sentences per locale (half our frames, half presidio-evaluator's templates),
    the same on every run for a seed."""
    from faker import Faker

    templates = _templates()
    out: list[IntlText] = []
    for i, locale in enumerate(LOCALES):
        rng = random.Random(f"{seed}:{locale}")
        fake = Faker(locale)
        fake.seed_instance(seed * 100 + i)
        for provider in fake.providers:
            # it_IT's cities are a list made from a set: in the hash's order, which differs
            # between processes; sorted, the draws are the same on every run
            if isinstance(getattr(provider, "cities", None), list):
                provider.cities = sorted(provider.cities)  # type: ignore[attr-defined]
        region = locale.split("_")[1]
        for k in range(per_locale):
            source = "frame" if k % 2 == 0 else "template"
            frame = rng.choice(FRAMES[locale] if source == "frame" else templates)
            text, spans, pos = "", [], 0
            for m in re.finditer(r"\{(\w+)\}", frame):
                text += frame[pos : m.start()]
                value = _value(m[1], fake, region, rng)
                spans.append((len(text), len(text) + len(value), _KIND[m[1]]))
                text += value
                pos = m.end()
            text += frame[pos:]
            out.append(IntlText(text, spans, locale, source))
    return out


# Numbers that are no phone number, in the locales' ways of writing them (false phones):
# order and invoice numbers, amounts, dates, times, versions, measures, ranges. Written here.
_NUMBER_FRAMES = (
    "Bestellnummer {order}, Betrag {amount} €.",
    "Rechnung Nr. {year}-{n5} vom {date}.",
    "Numéro de commande {order}, total {amount} €.",
    "Ordine n. {order} del {date}, importo {amount} euro.",
    "Pedido {order}: {amount} € con IVA.",
    "Ordernummer {order}, bedrag € {amount}.",
    "Order #{order} shipped on {date}, total £{amount}.",
    "Version {version} was released on {date}.",
    "Upgrade from {version} to {version2} before {date}.",
    "The meeting is from {time} to {time2} in room {room}.",
    "Population grew from {big} to {big2} between {year} and {year2}.",
    "Tracking number {tracking}, weight {kg} kg.",
    "Kundennummer {n8}, Vertragsnummer {n10}.",
    "Artikel {n6} kostet {amount} EUR, Lieferung in {n1}-{n2} Tagen.",
    "Référence {n8} / dossier {n6}.",
    "Il lotto {n6} scade il {date}.",
    "Código {n5} {n5b}, factura {n10}.",
    "Postbus {n4}, kenmerk {n8}.",
    "Invoice INV-{year}-{n6}, due {date}, amount {amount}.",
    "Scores: {n2}-{n1}, {n2}-{n2}, {n1}-{n2}.",
    "Coordinates {lat}, {lon}.",
    "ISBN 978-{n1}-{n4}-{n4b}-{n1}",
    "Serial {n4}-{n4b}-{n4}.",
    "The range is {n5}-{n5b} and the step is {n2}.",
)


def number_data(n: int, seed: int = 12) -> list[str]:
    """`n` sentences holding numbers that are no phone (nor any PII): every find is false."""
    rng = random.Random(seed)

    def digits(k: int) -> str:
        return str(rng.randrange(10 ** (k - 1), 10**k))

    def fill(slot: str) -> str:
        if slot in ("order", "n8"):
            return digits(8)
        if slot == "n10":
            return digits(10)
        if slot in ("n6",):
            return digits(6)
        if slot in ("n5", "n5b"):
            return digits(5)
        if slot in ("n4", "n4b"):
            return digits(4)
        if slot == "n2":
            return digits(2)
        if slot == "n1":
            return digits(1)
        if slot == "amount":
            whole = rng.randrange(1, 100000)
            sep, decimal = rng.choice(((".", ","), (",", "."), (" ", ","), ("", "."), ("", ",")))
            text = f"{whole:,}".replace(",", sep) if whole >= 1000 else str(whole)
            return text + decimal + digits(2)
        if slot in ("year", "year2"):
            return str(rng.randrange(1990, 2030))
        if slot == "date":
            d, m, y = rng.randrange(1, 29), rng.randrange(1, 13), rng.randrange(1990, 2030)
            return rng.choice((f"{d:02d}.{m:02d}.{y}", f"{d}/{m}/{y}", f"{y}-{m:02d}-{d:02d}"))
        if slot in ("version", "version2"):
            return ".".join(str(rng.randrange(0, 20)) for _ in range(rng.choice((2, 3, 4))))
        if slot in ("time", "time2"):
            return f"{rng.randrange(0, 24):02d}:{rng.randrange(0, 60):02d}"
        if slot in ("big", "big2"):
            return f"{rng.randrange(100000, 99999999):,}".replace(",", rng.choice((",", ".", " ")))
        if slot == "room":
            return digits(3)
        if slot == "tracking":
            return "1Z" + digits(8) + digits(8)
        if slot == "kg":
            return f"{rng.randrange(1, 99)},{digits(1)}"
        if slot in ("lat", "lon"):
            return f"{rng.uniform(-80, 80):.6f}"
        raise KeyError(slot)

    out = []
    for _ in range(n):
        frame = rng.choice(_NUMBER_FRAMES)
        out.append(re.sub(r"\{(\w+)\}", lambda m: fill(m[1]), frame))
    return out

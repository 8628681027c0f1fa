from datamodules.corpora.sentences import split_sentences


def test_splits_at_sentence_ends_only():
    text = 'Mr. Smith arrived. He said "Hello." Then he left! Was it late? (It was.) Next.'
    assert split_sentences(text) == [
        "Mr. Smith arrived.",
        'He said "Hello."',
        "Then he left!",
        "Was it late?",
        "(It was.)",
        "Next.",
    ]


def test_initials_abbreviations_and_numbers_do_not_split():
    text = "J. R. Tolkien wrote it, e.g. The Hobbit, in the U.S. It sold 3.5 million copies."
    assert split_sentences(text) == [text]
    assert split_sentences("Prices rose in 1990. Then they fell.") == [
        "Prices rose in 1990.",
        "Then they fell.",
    ]


def test_wikitext_spacing():
    text = " The road is 3 @.@ 5 km long . It opened in 1950 . \n = = History = = "
    assert split_sentences(text) == [
        "The road is 3 @.@ 5 km long .",
        "It opened in 1950 .",
        "= = History = =",
    ]


def test_paragraphs_never_share_a_sentence_and_no_text_is_lost():
    document = "first paragraph without a stop\n\nsecond one. Two sentences.\n   \n"
    sentences = split_sentences(document)
    assert sentences == ["first paragraph without a stop", "second one.", "Two sentences."]
    assert "".join(sentences).replace(" ", "") == document.replace(" ", "").replace("\n", "")
    assert split_sentences(" \n\n ") == []


def test_lower_case_continuation_is_not_a_boundary(embedded):
    assert split_sentences("see section 3. below for details.") == [
        "see section 3. below for details."
    ]
    # On real prose, sentences are sentence-sized: none empty, few very long.
    sentences = [s for doc in embedded.documents() for s in split_sentences(doc)]
    lengths = sorted(len(s.split()) for s in sentences)
    assert len(sentences) > 2000
    assert all(lengths)
    assert 8 <= lengths[len(lengths) // 2] <= 40

"""The job-end split: a held batch's unsent rows move to an idle GPU as a *part*.

When the queue is empty, a GPU has room, and a batch another GPU holds still has rows it has
not sent, the idle GPU would wait for the job's end. Instead its worker asks for those rows
(a request key) and the batch's owner answers at its next look (``scripts.grant_part``,
fenced by the owner's ownership token): rows it has not sent become a part, claimed by the
asker under a key of the part's own, renewed like a batch claim
(workers/delivery/ownership.py). The part's rows are recorded into the batch's progress hash by
the same script the owner uses (``scripts.record_rows``), fenced by the part's key instead of
the batch's, so a part whose claim lapsed (its worker killed, or frozen past its lease) records
nothing more.

The owner, once it has sent the rest, waits while a part is live and then sends whatever is
still missing: nothing, or the rows of a part that lapsed. Its result is written from the
progress hash as before, so the parts are merged by construction and every row is recorded
once (``HSETNX``). The owner dying mid-split changes nothing for the part: the batch's message
is redelivered (acks late) and its next owner waits for the live parts the same way.

- ``protocol``: what both sides share: the request, the part, the GPU-share tag of a part.
- ``asker``: the idle GPU's side: which batch to ask, the ask, the wait for the grant.
- ``owner``: the batch owner's side: its unsent rows, the grant or refusal, the live parts.

Keys (``JobKeys``): ``split_request`` (one at a time per batch), ``part`` the part's claim (its
asker's token), ``part_rows`` its unit keys, ``parts`` the part ids.
"""
